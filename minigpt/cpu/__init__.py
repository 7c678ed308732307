"""CPU speedups, applied from outside the core: ``speed_up_training`` and ``speed_up_decoding``
swap a built model's modules (or patch an instance's method) for faster CPU versions that keep
its ``Parameter`` objects, tied weights, state-dict keys and outputs (within rounding). Each
choice is a fixed rule; a speedup that cannot run on this CPU steps aside. Both return one line
per speedup saying what was applied and why (an empty list off the CPU).
"""

from __future__ import annotations

import ctypes
import sys

import torch
from torch import nn

from minigpt.attention import MultiHeadAttention
from minigpt.cpu import onednn
from minigpt.cpu.blocks import compile_blocks
from minigpt.cpu.loss import ChunkedNextTokenLoss
from minigpt.cpu.packed import ROWSUM, PackedLinear, fuse_into_compiled_steps, prompt_product

__all__ = ["keep_freed_host_memory", "speed_up_decoding", "speed_up_training"]
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers, glibc's <malloc.h>


def speed_up_training(model: nn.Module, *, precision: str = "32-true", compiled: bool = False,
                      keep_freed_memory: bool = True) -> list[str]:
    """Make a CPU model train faster, in place (before torch.compile / FSDP wrapping): compile
    the training forward of blocks with unfused options (``cpu.blocks``; not when ``compiled``,
    with a window or without a C++ compiler), the chunked LM-head loss (``cpu.loss``; not when
    ``compiled`` or in float16), ``keep_freed_host_memory`` (process-wide). Returns the lines."""
    applied: list[str] = []
    if _device_type(model) != "cpu":
        return applied
    if keep_freed_memory and keep_freed_host_memory():
        applied.append("glibc keeps freed memory")
    if compiled:
        return applied
    applied += compile_blocks(model)
    loss = getattr(model, "next_token_loss", None)
    if isinstance(loss, nn.Module) and not isinstance(loss, ChunkedNextTokenLoss) \
            and not str(precision).startswith("16"):
        model.next_token_loss = ChunkedNextTokenLoss(getattr(loss, "logit_softcap", None))
        applied.append("chunked LM-head loss")
    return applied


@torch.no_grad()
def speed_up_decoding(model: nn.Module, weight_dtype: torch.dtype = torch.float32, *,
                      traceable: bool = False) -> list[str]:
    """Lay a CPU model's linear weights out in ``weight_dtype`` for one-token decoding, in place,
    in eval mode (inference only: the copies do not follow weight updates; activations stay
    float32). ``traceable`` (a decode step compiled afterwards): the ``rowsum`` layout, a prompt's
    rows by ``prompt_product``, and the one-query attention fused into the step; else oneDNN-packed
    weights where this CPU can (float32 stays ``nn.Linear``, bfloat16 uses ``F.linear``, where it
    cannot). Returns the lines."""
    if weight_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"weight_dtype={weight_dtype} must be torch.float32 or torch.bfloat16")
    if _device_type(model) != "cpu":
        return []
    model.eval()
    # (parent, attribute name, layer) of every plain nn.Linear (a shared one under each parent)
    layers = [(parent, name, child) for parent in list(model.modules())
              for name, child in list(parent.named_children()) if type(child) is nn.Linear]
    if not layers:
        return []
    dtype = str(weight_dtype).removeprefix("torch.")
    if traceable:
        product = prompt_product(weight_dtype)
        _swap(layers, weight_dtype, ROWSUM, product)
        fused = sum(fuse_into_compiled_steps(m) for m in model.modules()
                    if isinstance(m, MultiHeadAttention))
        return [f"row-sum {dtype} weights ({len(layers)}: the compiled step streams each one-row "
                "product over the weight in its own loop)",
                f"a prompt's rows as {product} ({torch.get_num_threads()} thread(s), {dtype})",
                f"one-query attention fused into the compiled step ({fused})"]
    if weight_dtype == torch.float32 and not onednn.available():
        return [f"nn.Linear kept ({len(layers)}: oneDNN's linear op is missing from this "
                "PyTorch)"]
    if weight_dtype == torch.bfloat16 and not onednn.packs_bfloat16():
        _swap(layers, weight_dtype, "plain")
        return [f"bfloat16 weights through F.linear ({len(layers)}): oneDNN's packed bfloat16 "
                "layout needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; this CPU has "
                f"{onednn.cpu_capability()}"]
    _swap(layers, weight_dtype, "onednn")
    return [f"oneDNN-packed {dtype} linear weights ({len(layers)})"]


def keep_freed_host_memory(mmap_threshold: int = 1 << 30) -> bool:
    """Ask glibc to serve blocks below ``mmap_threshold`` bytes from its heap and never trim it,
    so that a CPU training step, freeing and making the same large tensors every step, stops
    page-faulting on fresh ``mmap`` regions (the process keeps its peak heap). Returns whether
    it took effect (False off Linux or without glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and \
        bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def _swap(slots: list, weight_dtype: torch.dtype, kernel: str, product: str = "x @ W.T") -> None:
    for parent, name, layer in slots:
        setattr(parent, name, PackedLinear(layer, weight_dtype, kernel, product))


def _device_type(model: nn.Module) -> str:
    first = next(model.parameters(), None)
    return first.device.type if first is not None else "cpu"
