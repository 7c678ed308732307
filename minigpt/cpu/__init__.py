"""CPU speedups, applied at the boundary: ``speed_up_training`` and ``speed_up_decoding``.

The core model (``minigpt.model``) is plain PyTorch and never imports this package. These two
calls swap a built model's modules for faster CPU versions that reuse the same ``Parameter``
objects (or compile a block's training forward in place), so outputs and gradients agree within
float32 rounding, tied weights stay tied and the state-dict keys do not change::

    model = GPT(GPTConfig(...))
    applied = minigpt.cpu.speed_up_training(model)      # before torch.compile / FSDP wrapping
    model = GPT.from_pretrained("gpt2")
    applied = minigpt.cpu.speed_up_decoding(model)      # inference only

Each returns what it applied and why (an empty list off the CPU or where a kernel is missing).
Where oneDNN or another weight layout is only faster on some CPUs, the choice is made per shape
from this machine's timings (``minigpt.cpu.tuning``: measured on first use, then read from a
small file), and the line gives each shape's measured ratio (fastest candidate / default) and
whether it was cached or measured now. A resumed training run applies the float32 decisions its
checkpoint stored (``Applied.kernels``) instead, so it rounds as the run so far did. The
training run and the generate/viz entry points call them once (config ``cpu_speedups``) and log
that list.
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
from minigpt.cpu.decode_attention import one_query_attention
from minigpt.cpu.host_memory import keep_freed_memory as _keep_freed_memory
from minigpt.cpu.linear import MATMULS, OneDNNLinear, measure_matmuls, timed_shape, train_key
from minigpt.cpu.loss import ChunkedNextTokenLoss
from minigpt.cpu.packed import (
    PROMPT_PRODUCTS,
    ROWSUM,
    PackedLinear,
    decode_key,
    measure_decoding,
    measure_prompt,
    prompt_key,
)
from minigpt.cpu.tuning import KernelChoices, describe, pick, shape_of

__all__ = ["Applied", "KernelChoices", "speed_up_decoding", "speed_up_training"]

STORED = "as stored in the checkpoint"  # why, for kernels a resumed run takes from its checkpoint


class Applied(list):
    """What ``speed_up_training`` applied, one line each, and ``kernels``: the float32 kernel
    decisions it took (``{"matmuls": {timings key: "onednn" | "mkl"}, "lm_head_loss_onednn":
    bool}``), None where it took none (not float32, not on the CPU, compiled). A checkpoint
    stores ``kernels`` so that a resumed run multiplies with the same kernels."""

    kernels: dict | None = None


def speed_up_training(model: nn.Module, *, precision: str = "32-true", compiled: bool = False,
                      keep_freed_memory: bool = True, kernels: KernelChoices | None = None,
                      stored_kernels: dict | None = None) -> Applied:
    """Make a CPU model train faster, in place; return what was applied, and why.

    * blocks with options that have no fused CPU kernel (RMSNorm, QK-norm, rotary embeddings,
      ReLU²; ``minigpt.cpu.blocks``) compile their training forward, unless ``compiled`` (the
      whole model is), the model has a sliding window or no C++ compiler is found;
    * in float32 (``precision`` 32-true), each matmul of the other blocks' and the head's linear
      layers multiplies on oneDNN (``minigpt.cpu.linear``) where ``kernels`` (this machine's
      timings, ``minigpt.cpu.tuning``; measured on first use) found oneDNN faster for its shape;
      ``stored_kernels`` (an earlier ``Applied.kernels``, from the checkpoint a run resumes)
      decides instead, without measuring: the same kernels round the same way;
    * the LM-head loss runs in chunks without materializing the logits (``minigpt.cpu.loss``,
      soft-capped as the model's), unless ``compiled`` or ``precision`` is float16;
    * glibc keeps freed large blocks for reuse (``minigpt.cpu.host_memory``; process-wide).
    """
    applied = Applied()
    if _device_type(model) != "cpu":
        return applied
    if keep_freed_memory and _keep_freed_memory():
        applied.append("glibc keeps freed memory")
    if compiled:
        return applied
    compiled_blocks = _compile_blocks(model, applied)
    float32 = str(precision).startswith("32") and onednn.available()
    head_onednn, head_why = False, ""
    if float32:
        head_onednn, head_why, applied.kernels = _onednn_training(
            model, compiled_blocks, kernels or KernelChoices(), applied,
            _valid_kernels(stored_kernels))
    loss = getattr(model, "next_token_loss", None)
    if isinstance(loss, nn.Module) and not isinstance(loss, ChunkedNextTokenLoss) \
            and not str(precision).startswith("16"):
        model.next_token_loss = ChunkedNextTokenLoss(getattr(loss, "logit_softcap", None),
                                                     onednn=head_onednn)
        gemms = _head_gemms(head_onednn, head_why) if float32 else ""
        applied.append(f"chunked LM-head loss{gemms}")
    return applied


def _onednn_training(model: nn.Module, compiled_blocks: list[nn.Module], kernels: KernelChoices,
                     applied: list[str], stored: dict | None
                     ) -> tuple[bool, str, dict | None]:
    """Swap in ``OneDNNLinear`` with the matmuls ``stored`` (decisions of an earlier run) or
    else ``kernels`` picks for each layer's shape (noted in ``applied``); return whether the
    LM-head loss multiplies on oneDNN, why, and the decisions (``Applied.kernels``)."""
    layers = _linears(model, keep=compiled_blocks)
    head = getattr(model, "lm_head", None)
    if not layers:  # all swapped by an earlier call
        return isinstance(head, OneDNNLinear), "as before", None
    timed = [*layers, *([head] if isinstance(head, nn.Linear) and head not in layers else [])]
    shapes = {train_key(layer, op): timed_shape(layer, op) for layer in timed for op in MATMULS}
    if stored is not None:
        # Applied even on another CPU model than the one that measured them: a kernel choice
        # changes only speed, and rounding like the run so far is what a resume promises.
        # A shape the stored run did not multiply on its own (a block it compiled) keeps
        # PyTorch's default.
        matmuls = {key: stored["matmuls"].get(key, "mkl") for key in shapes}
        head_onednn = stored["lm_head_loss_onednn"]
        why = head_why = STORED
    else:
        matmuls, head_onednn, why, head_why = _measured_choices(shapes, head, kernels)
    swapped = 0
    for parent, name, layer in _linear_slots(model, layers):
        ops = [op for op in MATMULS if matmuls[train_key(layer, op)] == "onednn"]
        if ops:
            setattr(parent, name, OneDNNLinear.like(layer, ops))
            swapped += 1
    applied.append(f"oneDNN float32 matmuls in {swapped} of {len(layers)} linear layers ({why})")
    head_onednn = head_onednn and isinstance(head, nn.Linear)
    return head_onednn, head_why, {"matmuls": matmuls, "lm_head_loss_onednn": head_onednn}


def _measured_choices(shapes: dict[str, tuple], head: nn.Module | None, kernels: KernelChoices
                      ) -> tuple[dict[str, str], bool, str, str]:
    """The kernel of each training key in ``shapes`` from this machine's timings, whether the
    LM-head loss multiplies on oneDNN, and why (for the layers, for the head)."""
    timings, cached = kernels.timings(shapes, lambda keys: measure_matmuls(
        {k: shapes[k] for k in keys}), "mkl")
    choices = {key: pick(timings[key], "mkl", key in cached) for key in shapes}
    per_op = {op: {k: c for k, c in choices.items() if k.endswith(op)} for op in MATMULS}
    why = " | ".join(f"{op}: {describe(per_op[op], shape_of)}" for op in MATMULS)
    matmuls = {key: choice.kernel for key, choice in choices.items()}
    if not isinstance(head, nn.Linear):
        return matmuls, False, why, "not measured"
    total = {kernel: sum(timings[train_key(head, op)][kernel] for op in MATMULS)
             for kernel in ("mkl", "onednn")}
    choice = pick(total, "mkl", all(train_key(head, op) in cached for op in MATMULS))
    return matmuls, choice.kernel == "onednn", why, describe({"three matmuls": choice})


def _head_gemms(onednn_: bool, why: str) -> str:
    """The LM-head loss's GEMMs and why, for its line."""
    if why == STORED:
        return f" ({'oneDNN' if onednn_ else 'PyTorch default'} GEMMs, {why})"
    return f" (oneDNN GEMMs: {why})" if onednn_ else f" (PyTorch's GEMMs: oneDNN {why})"


def _valid_kernels(stored) -> dict | None:
    """``stored`` if it is an ``Applied.kernels`` record, else None (then measure as usual: a
    checkpoint's record is data, and a malformed one must not decide anything)."""
    if not isinstance(stored, dict):
        return None
    matmuls, head = stored.get("matmuls"), stored.get("lm_head_loss_onednn")
    if not isinstance(matmuls, dict) or not isinstance(head, bool) or not all(
            isinstance(k, str) and v in ("onednn", "mkl") for k, v in matmuls.items()):
        return None
    return stored


@torch.no_grad()
def speed_up_decoding(model: nn.Module, weight_dtype: torch.dtype = torch.float32,
                      kernels: KernelChoices | None = None, *, traceable: bool = False
                      ) -> list[str]:
    """Lay a CPU model's linear weights out for one-token-at-a-time decoding, in place, and put
    it in eval mode; return what was applied, and why. Activations stay float32.

    * ``traceable`` (for a decode step compiled afterwards): every layer takes the ``rowsum``
      layout in ``weight_dtype``, which the compiled step reads in one streaming pass, and
      every attention's one-token step is written for inductor to fuse
      (``minigpt.cpu.decode_attention``); a prompt's rows are multiplied by whichever of
      ``PROMPT_PRODUCTS`` this machine's timings found faster for the shape;
    * else bfloat16 ``weight_dtype``: every layer multiplies oneDNN-packed bfloat16 weights;
    * else float32: each layer's shape takes the layout ``kernels`` (this machine's timings,
      ``minigpt.cpu.tuning``; measured on first use) found fastest (``minigpt.cpu.packed``),
      or stays ``nn.Linear``.

    Inference only: the copies do not follow later weight updates."""
    if weight_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"weight_dtype={weight_dtype} must be torch.float32 or torch.bfloat16")
    if _device_type(model) != "cpu" or not onednn.available():
        return []
    model.eval()
    layers = _linears(model)
    if not layers:
        return []
    if traceable:  # one layout for every layer; a prompt's product measured per shape
        keys = [prompt_key(layer, weight_dtype) for layer in layers]
        default = PROMPT_PRODUCTS[0]
        timings, cached = (kernels or KernelChoices()).timings(
            keys, lambda missing: measure_prompt(layers, missing, weight_dtype), default)
        choices = {key: pick(timings[key], default, key in cached) for key in keys}
        for parent, name, layer in _linear_slots(model, layers):
            product = choices[prompt_key(layer, weight_dtype)].kernel
            setattr(parent, name, PackedLinear.like(layer, weight_dtype, ROWSUM, product))
        attentions = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
        for attention in attentions:
            attention.decode_attention = one_query_attention
        return [f"row-sum {str(weight_dtype).removeprefix('torch.')} weights ({len(layers)}: "
                "the compiled step streams each one-row product over the weight in its own loop)",
                *_applied_lines(keys, choices, {"W @ x.T": "a prompt's rows as W @ x.T",
                                                "x @ W.T": "a prompt's rows as x @ W.T kept"}),
                f"one-query attention fused into the compiled step ({len(attentions)})"]
    if weight_dtype == torch.bfloat16:  # the one eager bfloat16 layout, untimed
        for parent, name, layer in _linear_slots(model, layers):
            setattr(parent, name, PackedLinear.like(layer, weight_dtype, "onednn"))
        return [f"oneDNN-packed bfloat16 linear weights ({len(layers)})"]
    keys = [decode_key(layer) for layer in layers]
    timings, cached = (kernels or KernelChoices()).timings(
        keys, lambda missing: measure_decoding(layers, missing), "plain")
    choices = {key: pick(timings[key], "plain", key in cached) for key in keys}
    for parent, name, layer in _linear_slots(model, layers):
        kernel = choices[decode_key(layer)].kernel
        if kernel != "plain":
            setattr(parent, name, PackedLinear.like(layer, weight_dtype, kernel))
    return _applied_lines(keys, choices, {"onednn": "oneDNN-packed float32 weights",
                                          "mkl": "(in, out) MKL float32 weights",
                                          "plain": "nn.Linear kept"})


def _applied_lines(keys: list[str], choices: dict, labels: dict[str, str]) -> list[str]:
    """One line per kernel in ``labels`` (kernel -> words) that some layer took: its words, the
    number of layers (``keys``: one per layer) and each of its shapes' measured ratio."""
    lines = []
    for kernel, label in labels.items():
        mine = {k: c for k, c in choices.items() if c.kernel == kernel}
        if mine:
            count = sum(choices[key].kernel == kernel for key in keys)
            lines.append(f"{label} ({count}: {describe(mine, shape_of)})")
    return lines


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


def _linears(model: nn.Module, keep: list[nn.Module] = ()) -> list[nn.Linear]:
    """Every plain ``nn.Linear`` below ``model`` (not already swapped), except below ``keep``;
    each once (a shared layer is one layer)."""
    return list(dict.fromkeys(layer for _, _, layer in _linear_slots(model, keep=keep)))


def _linear_slots(model: nn.Module, layers=None, keep: list[nn.Module] = ()):
    """(parent, attribute name, layer) of every plain ``nn.Linear`` below ``model`` (only those
    in ``layers`` when given), except below ``keep``."""
    kept = {id(m) for module in keep for m in module.modules()}
    wanted = None if layers is None else {id(layer) for layer in layers}
    for parent in list(model.modules()):
        if id(parent) in kept:
            continue
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and (wanted is None or id(child) in wanted):
                yield parent, name, child
