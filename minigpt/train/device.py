"""Which device a run trains on, in which precision, and whether it compiles."""

from __future__ import annotations

import torch


def resolve_accelerator(accelerator: str | None) -> str:
    """``cpu`` or ``gpu`` for Lightning's ``auto`` (what Lightning itself picks); other names
    (``mps``, ``tpu``...) as given."""
    if accelerator in (None, "auto"):
        return "gpu" if torch.cuda.is_available() else "cpu"
    return "gpu" if accelerator == "cuda" else accelerator


def cpu_has_native_bf16() -> bool:
    """AMX or AVX512-BF16: the CPU multiplies bfloat16 in hardware."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
        if "amx_bf16" in flags or "avx512_bf16" in flags:
            return True
    except OSError:
        pass
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool((check and check()) or (amx and amx()))


def default_precision(accelerator: str) -> str:
    """Lightning precision for a device: ``bf16-mixed`` where the hardware multiplies bf16
    natively (Ampere and newer GPUs; CPUs with AMX or AVX512-BF16), ``16-mixed`` (with a grad
    scaler) on older GPUs, ``32-true`` elsewhere. Emulated bf16 (V100, T4) would run at a
    fraction of the fp16 tensor-core speed, so it does not count."""
    accelerator = resolve_accelerator(accelerator)
    if accelerator == "gpu":
        if not torch.cuda.is_available():
            return "32-true"
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return "bf16-mixed" if native else "16-mixed"
    if accelerator == "cpu":
        return "bf16-mixed" if cpu_has_native_bf16() else "32-true"
    return "32-true"


def fsdp_mixed_precision(precision: str):
    """FSDP's ``MixedPrecision`` for a Lightning precision: parameters unsharded in the half
    type for the matmuls, gradients reduced and buffers kept in float32 (a sum over many ranks
    in bf16 loses the small contributions). None where FSDP needs no casting (``32-true``) or
    the user chose a pure half-precision run (``bf16-true``), which Lightning configures.

    ``cast_forward_inputs``: each Block unit casts its input to the half type, so a forward
    outside training (sampling, where only the root's parameters are gathered, in float32) feeds
    the blocks what training feeds them."""
    half = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(str(precision))
    if half is None:
        return None
    from torch.distributed.fsdp import MixedPrecision

    return MixedPrecision(param_dtype=half, reduce_dtype=torch.float32, buffer_dtype=torch.float32,
                          cast_forward_inputs=True)


def compile_enabled(compile_option, accelerator: str | None) -> bool:
    """``compile: auto`` is on for GPUs (the compiled forward + loss is much faster there) and
    off on CPUs (compiling takes long to start on a few cores); true/false as given."""
    if compile_option == "auto":
        return resolve_accelerator(accelerator) == "gpu"
    return bool(compile_option)
