"""oneDNN's linear op on a packed weight copy (private ops: ``pack``, ``linear``), the eager
decoding layout's kernel. ``available()`` (float32) and ``packs_bfloat16()`` try them once on a
tiny product before anything trusts them; bfloat16 needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def pack(weight: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """A copy of ``weight`` (out, in) in ``dtype``, blocked for products of one row (any row
    count works)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype), 1)


def linear(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ W.T + bias`` for rows ``x`` (N, in) in ``packed``'s dtype, ``packed = pack(W)``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _multiplies(dtype: torch.dtype) -> bool:
    """A packed product in ``dtype`` runs here and gives ``a @ b.T``."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        a = (torch.arange(32, dtype=torch.float32).view(8, 4) / 8).to(dtype)  # no RNG: seeds alone
        b = (torch.arange(24, dtype=torch.float32).view(6, 4) / 8).to(dtype)  # exact in bf16
        return torch.allclose(linear(a, pack(b, dtype)).float(), a.float() @ b.float().T,
                              rtol=1e-2, atol=1e-2)
    except (AttributeError, RuntimeError):  # a PyTorch without the op, a CPU without the path
        return False


@functools.cache
def available() -> bool:
    """PyTorch has oneDNN and its packed float32 linear behaves as this package expects; else
    ``False`` (plain layers), not errors."""
    return _multiplies(torch.float32)


@functools.cache
def packs_bfloat16() -> bool:
    """oneDNN packs and multiplies bfloat16 weights on this CPU (not on AVX2-only CPUs)."""
    return available() and _multiplies(torch.bfloat16)


def cpu_capability() -> str:
    """The vector instructions PyTorch's kernels use here (e.g. 'AVX2', 'AVX512')."""
    return torch.backends.cpu.get_cpu_capability()
