"""Which device a command runs on (the check every command line shares) and in which number
type (``preferred_dtype``, one rule for training and inference)."""

from __future__ import annotations

import torch

from minigpt.errors import UserError

DTYPES = ("auto", "float32", "bfloat16", "float16")  # what a command line's dtype= may say


def cpu_has_native_bf16() -> bool:
    """AMX or AVX512-BF16: the CPU multiplies bfloat16 in hardware (asked through torch's
    cpuinfo, which reads the CPU itself)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def has_native_bf16(device_type: str) -> bool:
    """Whether this machine's ``device_type`` multiplies bfloat16 in hardware, not emulated."""
    if device_type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device_type == "cpu":
        return cpu_has_native_bf16()
    return False


def preferred_dtype(device_type: str, native_bf16: bool) -> torch.dtype:
    """bfloat16 where it is native; else float16 on a CUDA GPU, float32 elsewhere."""
    if native_bf16 and device_type in ("cuda", "cpu"):
        return torch.bfloat16
    return torch.float16 if device_type == "cuda" else torch.float32


def inference_dtype(name: str, device: str) -> torch.dtype:
    """``dtype=name`` on ``device``: ``auto`` follows ``preferred_dtype`` for this machine."""
    if name not in DTYPES:
        raise UserError(f"dtype={name!r} must be one of {DTYPES}")
    if name != "auto":
        return getattr(torch, name)
    device_type = torch.device(device).type
    return preferred_dtype(device_type, has_native_bf16(device_type))


def check_device(name: str) -> str:
    """``device=auto``: cuda if there is a GPU, else cpu; another name as given, once checked to
    exist here (else a ``UserError`` naming what this machine offers)."""
    gpus = torch.cuda.device_count()
    if name == "auto":
        return "cuda" if gpus else "cpu"
    mps = torch.backends.mps.is_available()
    offers = "device=cpu" + (f", device=cuda (or cuda:0 .. cuda:{gpus - 1})" if gpus else "") \
        + (", device=mps" if mps else "") + " or device=auto"
    try:
        kind = torch.device(str(name))
    except (RuntimeError, TypeError, ValueError):
        raise UserError(f"device={name!r} is not a device name; this machine offers "
                        f"{offers}") from None
    if kind.type == "cpu" or (kind.type == "mps" and mps) or \
            (kind.type == "cuda" and (kind.index or 0) < gpus):
        return str(name)
    has = f"{gpus} CUDA GPU(s)" if gpus else "no CUDA GPU" + (
        f" (this torch {torch.__version__} is built without CUDA)" if torch.version.cuda is None
        else "")
    raise UserError(f"device={name!r} is not on this machine, which has {has}; it offers "
                    f"{offers}")
