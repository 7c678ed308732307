"""CPU speedups, applied at the boundary: ``speed_up_training`` and ``speed_up_decoding``.

The core model (``minigpt.model``) is plain PyTorch, never imports this package and carries no
hook for it. These two calls swap a built model's modules for faster CPU versions that reuse the
same ``Parameter`` objects, or patch an instance's method in place (a block's training forward,
an attention's compiled one-query step), so outputs and gradients agree within rounding, tied
weights stay tied and the state-dict keys do not change::

    model = GPT(GPTConfig(...))
    applied = minigpt.cpu.speed_up_training(model)      # before torch.compile / FSDP wrapping
    model = GPT.from_pretrained("gpt2")
    applied = minigpt.cpu.speed_up_decoding(model)      # inference only

Each returns what it applied and why, one line each (an empty list off the CPU). Every choice is
a fixed rule, none is timed; a speedup asks the CPU (or PyTorch) whether it can run here, and
where it cannot it steps aside and its line says so. The training run and the generate/viz entry
points call them once (config ``cpu_speedups``) and log that list.
"""

from __future__ import annotations

import torch
from torch import nn

from minigpt.attention import MultiHeadAttention
from minigpt.cpu import onednn
from minigpt.cpu.blocks import (
    compile_training_forward,
    compiler_works,
    is_compiled_for_training,
    unfused_options,
)
from minigpt.cpu.decode_attention import fuse_into_compiled_steps
from minigpt.cpu.host_memory import keep_freed_memory as _keep_freed_memory
from minigpt.cpu.loss import ChunkedNextTokenLoss
from minigpt.cpu.packed import ROWSUM, PackedLinear, prompt_product

__all__ = ["speed_up_decoding", "speed_up_training"]


def speed_up_training(model: nn.Module, *, precision: str = "32-true", compiled: bool = False,
                      keep_freed_memory: bool = True) -> list[str]:
    """Make a CPU model train faster, in place; return what was applied, and why.

    * blocks with options that have no fused CPU kernel (RMSNorm, QK-norm, rotary embeddings,
      ReLU²; ``minigpt.cpu.blocks``) compile their training forward, unless ``compiled`` (the
      whole model is), the model has a sliding window or no C++ compiler is found;
    * the LM-head loss runs in chunks without materializing the logits (``minigpt.cpu.loss``,
      soft-capped as the model's), unless ``compiled`` or ``precision`` is float16;
    * glibc keeps freed large blocks for reuse (``minigpt.cpu.host_memory``; process-wide).
    """
    applied: list[str] = []
    if _device_type(model) != "cpu":
        return applied
    if keep_freed_memory and _keep_freed_memory():
        applied.append("glibc keeps freed memory")
    if compiled:
        return applied
    _compile_blocks(model, applied)
    loss = getattr(model, "next_token_loss", None)
    if isinstance(loss, nn.Module) and not isinstance(loss, ChunkedNextTokenLoss) \
            and not str(precision).startswith("16"):
        model.next_token_loss = ChunkedNextTokenLoss(getattr(loss, "logit_softcap", None))
        applied.append("chunked LM-head loss")
    return applied


@torch.no_grad()
def speed_up_decoding(model: nn.Module, weight_dtype: torch.dtype = torch.float32, *,
                      traceable: bool = False) -> list[str]:
    """Lay a CPU model's linear weights out in ``weight_dtype`` for one-token-at-a-time decoding,
    in place, and put it in eval mode; return what was applied, and why. Activations stay
    float32 (``minigpt.cpu.packed`` has the layouts).

    * ``traceable`` (for a decode step compiled afterwards): every layer takes the ``rowsum``
      layout, which the compiled step reads in one streaming pass, a prompt's rows multiplied
      as ``prompt_product`` says for this thread count, and every attention's one-token step is
      written for inductor to fuse (``minigpt.cpu.decode_attention``);
    * else every layer multiplies oneDNN-packed weights; where this CPU or PyTorch cannot,
      float32 layers stay ``nn.Linear`` and bfloat16 ones multiply a bfloat16 copy by
      ``F.linear``.

    Inference only: the copies do not follow later weight updates."""
    if weight_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"weight_dtype={weight_dtype} must be torch.float32 or torch.bfloat16")
    if _device_type(model) != "cpu":
        return []
    model.eval()
    layers = _linear_slots(model)
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


def _swap(slots: list, weight_dtype: torch.dtype, kernel: str, product: str = "x @ W.T") -> None:
    for parent, name, layer in slots:
        setattr(parent, name, PackedLinear.like(layer, weight_dtype, kernel, product))


def _device_type(model: nn.Module) -> str:
    first = next(model.parameters(), None)
    return first.device.type if first is not None else "cpu"


def _compile_blocks(model: nn.Module, applied: list[str]) -> None:
    """Compile the training forward of ``model.blocks`` when their options run unfused (noted in
    ``applied``)."""
    config, blocks = getattr(model, "config", None), getattr(model, "blocks", None)
    options = unfused_options(config) if config is not None and blocks is not None else []
    if not options:
        return
    if config.window is not None:
        applied.append(f"eager blocks ({', '.join(options)}; window: not compiled)")
        return
    if not compiler_works():
        applied.append(f"eager blocks ({', '.join(options)}; torch.compile found no C++ compiler)")
        return
    todo = [block for block in blocks if not is_compiled_for_training(block)]
    for block in todo:
        compile_training_forward(block)
    if todo:
        applied.append(f"compiled blocks ({', '.join(options)}) ({len(todo)})")


def _linear_slots(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute name, layer) of every plain ``nn.Linear`` below ``model`` (not already
    swapped); a layer shared by two parents appears under each."""
    return [(parent, name, child) for parent in list(model.modules())
            for name, child in list(parent.named_children()) if type(child) is nn.Linear]
