"""oneDNN's linear op, the one CPU kernel the speedups in this package build on.

``torch.ops.mkldnn._linear_pointwise(a, b, bias, ...)`` computes ``a @ b.T + bias`` for 2-D
operands and reads a strided ``b`` in place. It is a private op, so ``available()`` checks it once
on a small product (on first use, never at import) before anything trusts it.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def matmul_nt(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """``a @ b.T (+ bias)`` for 2-D CPU tensors, on oneDNN. ``b`` may be any strided view (read
    in place); a non-contiguous ``a`` is copied first."""
    return torch.ops.mkldnn._linear_pointwise(a, b, bias, "none", [], "")


@functools.cache
def available() -> bool:
    """PyTorch has oneDNN and its linear op multiplies a strided weight as this package expects;
    a PyTorch version where the op behaves differently gets ``False`` (plain layers), not errors."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        a = torch.arange(32, dtype=torch.float32).view(8, 4) / 7  # no RNG: leave seeds alone
        b = torch.arange(24, dtype=torch.float32).view(4, 6) / 5
        return torch.allclose(matmul_nt(a, b.t()), a @ b, rtol=1e-5, atol=1e-5)
    except (AttributeError, RuntimeError):
        return False
