"""CPU speedups, applied at the boundary: ``speed_up_training`` and ``speed_up_decoding``.

The core model (``minigpt.model``) is plain PyTorch and never imports this package. These two
calls swap a built model's modules for faster CPU versions that reuse the same ``Parameter``
objects (or compile a block's training forward in place), so outputs and gradients agree within
float32 rounding, tied weights stay tied and the state-dict keys do not change::

    model = GPT(GPTConfig(...))
    applied = minigpt.cpu.speed_up_training(model)      # before torch.compile / FSDP wrapping
    model = GPT.from_pretrained("gpt2")
    applied = minigpt.cpu.speed_up_decoding(model)      # inference only

Each returns what it applied (an empty list off the CPU or where a kernel is missing). The
training run and the generate/viz entry points call them once (config ``cpu_speedups``) and log
that list.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from minigpt.cpu import onednn
from minigpt.cpu.blocks import (
    compile_training_forward,
    compiler_works,
    is_compiled_for_training,
    unfused_options,
)
from minigpt.cpu.host_memory import keep_freed_memory as _keep_freed_memory
from minigpt.cpu.linear import OneDNNLinear
from minigpt.cpu.loss import ChunkedNextTokenLoss
from minigpt.cpu.packed import PackedLinear

__all__ = ["speed_up_decoding", "speed_up_training"]


def speed_up_training(model: nn.Module, *, precision: str = "32-true", compiled: bool = False,
                      keep_freed_memory: bool = True) -> list[str]:
    """Make a CPU model train faster, in place; return what was applied.

    * blocks with options that have no fused CPU kernel (RMSNorm, QK-norm, rotary embeddings,
      ReLU²; ``minigpt.cpu.blocks``) compile their training forward, unless ``compiled`` (the
      whole model is), the model has a sliding window or no C++ compiler is found;
    * float32 linear layers of the other blocks and the head multiply on oneDNN
      (``minigpt.cpu.linear``), unless ``compiled`` (the compiler picks its own kernels);
    * the LM-head loss runs in chunks without materializing the logits (``minigpt.cpu.loss``,
      soft-capped as the model's), unless ``compiled`` or ``precision`` is float16;
    * glibc keeps freed large blocks for reuse (``minigpt.cpu.host_memory``; process-wide).
    """
    if _device_type(model) != "cpu":
        return []
    applied = []
    if keep_freed_memory and _keep_freed_memory():
        applied.append("glibc keeps freed memory")
    if compiled:
        return applied
    compiled_blocks = _compile_blocks(model, applied)
    if onednn.available():
        n = _swap_linears(model, OneDNNLinear.like, skip=OneDNNLinear, keep=compiled_blocks)
        if n:
            applied.append(f"oneDNN float32 linear layers ({n})")
    loss = getattr(model, "next_token_loss", None)
    if isinstance(loss, nn.Module) and not isinstance(loss, ChunkedNextTokenLoss) \
            and not str(precision).startswith("16"):
        model.next_token_loss = ChunkedNextTokenLoss(getattr(loss, "logit_softcap", None))
        applied.append("chunked LM-head loss")
    return applied


@torch.no_grad()
def speed_up_decoding(model: nn.Module, weight_dtype: torch.dtype = torch.float32) -> list[str]:
    """Pack a CPU model's linear weights for one-token-at-a-time decoding (optionally as
    bfloat16 weights, float32 activations), in place, and put it in eval mode; return what was
    applied. Inference only: the packed copies do not follow later weight updates."""
    if weight_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"weight_dtype={weight_dtype} must be torch.float32 or torch.bfloat16")
    if _device_type(model) != "cpu" or not onednn.available():
        return []
    n = _swap_linears(model, lambda layer: PackedLinear.like(layer, weight_dtype), skip=PackedLinear)
    model.eval()
    dtype = str(weight_dtype).removeprefix("torch.")
    return [f"oneDNN-packed {dtype} linear weights ({n})"] if n else []


def _device_type(model: nn.Module) -> str:
    first = next(model.parameters(), None)
    return first.device.type if first is not None else "cpu"


def _compile_blocks(model: nn.Module, applied: list[str]) -> list[nn.Module]:
    """Compile the training forward of ``model.blocks`` when their options run unfused (noted in
    ``applied``); return the compiled blocks."""
    config, blocks = getattr(model, "config", None), getattr(model, "blocks", None)
    options = unfused_options(config) if config is not None and blocks is not None else []
    if not options:
        return []
    if config.window is not None:
        applied.append(f"eager blocks ({', '.join(options)}; window: not compiled)")
        return []
    if not compiler_works():
        applied.append(f"eager blocks ({', '.join(options)}; torch.compile found no C++ compiler)")
        return []
    todo = [block for block in blocks if not is_compiled_for_training(block)]
    for block in todo:
        compile_training_forward(block)
    if todo:
        applied.append(f"compiled blocks ({', '.join(options)}) ({len(todo)})")
    return list(blocks)


def _swap_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module], skip: type,
                  keep: list[nn.Module] = ()) -> int:
    """Replace every ``nn.Linear`` below ``model``, except below ``keep``, by ``make(layer)``;
    return how many."""
    kept = {id(m) for module in keep for m in module.modules()}
    count = 0
    for parent in list(model.modules()):
        if id(parent) in kept:
            continue
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and not isinstance(child, skip):
                setattr(parent, name, make(child))
                count += 1
    return count
