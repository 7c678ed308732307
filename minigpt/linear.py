"""``nn.Linear`` whose float32 CPU matmuls run on oneDNN: the model's one linear layer.

PyTorch multiplies float32 matrices on the CPU with MKL's SGEMM. On AMD CPUs MKL takes its
AVX2 code path even where the CPU has AVX-512, while oneDNN (also inside PyTorch) picks kernels
by the CPU's features: on this 2-core Zen 5 machine a training-sized GEMM runs at about 220
GFLOP/s through MKL and 400-520 GFLOP/s through oneDNN, in full float32 (bench/README.md). On
Intel CPUs the two are about even. So the forward pass and both backward matmuls of a float32
CPU ``Linear`` go through ``torch.ops.mkldnn._linear_pointwise``, which computes
``input @ weight.T + bias`` for 2-D operands (a strided weight is read in place):

* forward:      y  = x @ W.T + b     -> _linear_pointwise(x, W, b)
* input grad:   dx = dy @ W          -> _linear_pointwise(dy, W.T)
* weight grad:  dW = dy.T @ x        -> _linear_pointwise(dy.T, x.T), or its transpose

Everything else (CUDA, bfloat16/float16, autocast, ``torch.compile``, tensor subclasses such as
FSDP's DTensor, a PyTorch built without oneDNN) takes ``F.linear`` unchanged, as does the whole
model when ``MINIGPT_ONEDNN_LINEAR=0`` is set. Parameters and state-dict keys are
``nn.Linear``'s, so checkpoints do not depend on the path taken.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Fewer rows than this: a matrix-vector-like product (decoding), where oneDNN's per-call setup
# for an unpacked weight costs more than it saves (minigpt.packed handles decoding).
MIN_ROWS = 8


def _onednn_available() -> bool:
    """oneDNN is built in, not switched off, and its linear op (a private one) multiplies a
    strided weight as this module expects: checked once on a small product, so a PyTorch
    version where that op behaves differently falls back to ``F.linear`` instead of failing."""
    if os.environ.get("MINIGPT_ONEDNN_LINEAR", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        a = torch.arange(32, dtype=torch.float32).view(8, 4) / 7  # no RNG: leave seeds alone
        b = torch.arange(24, dtype=torch.float32).view(4, 6) / 5
        return torch.allclose(matmul_nt(a, b.t()), a @ b, rtol=1e-5, atol=1e-5)
    except (AttributeError, RuntimeError):
        return False


def matmul_nt(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """``a @ b.T (+ bias)`` for 2-D float32 CPU tensors, on oneDNN. ``b`` may be any strided view
    (read in place); a non-contiguous ``a`` is copied first."""
    return torch.ops.mkldnn._linear_pointwise(a, b, bias, "none", [], "")


ONEDNN_AVAILABLE = _onednn_available()


@contextlib.contextmanager
def onednn_enabled(enabled: bool):
    """Within this context take the oneDNN path (where it applies) or not: for comparisons such
    as the benchmarks' "default GEMM" rows. Process-wide, not thread-local."""
    global ONEDNN_AVAILABLE
    saved = ONEDNN_AVAILABLE
    ONEDNN_AVAILABLE = saved and enabled
    try:
        yield
    finally:
        ONEDNN_AVAILABLE = saved


def weight_grad(grad_rows: Tensor, rows: Tensor) -> Tensor:
    """``grad_rows.T @ rows`` (out, in) for a linear layer's weight, on oneDNN.

    oneDNN reads a strided second operand in place but copies a strided first one, and either
    form needs one transposed operand: ``grad_rows.T @ rows`` copies ``grad_rows`` (N x out),
    ``(rows.T @ grad_rows).T`` copies ``rows`` (N x in) and returns a transposed view, which
    autograd lays out like the weight (one in x out copy). Take whichever copies less.
    """
    (n, out_features), in_features = grad_rows.shape, rows.shape[1]
    if n * out_features <= in_features * (n + out_features):
        return matmul_nt(grad_rows.t(), rows.t())
    return matmul_nt(rows.t(), grad_rows.t()).t()


def uses_onednn(x: Tensor, weight: Tensor) -> bool:
    """Whether ``linear(x, weight)`` takes the oneDNN path (see the module docstring)."""
    return (
        ONEDNN_AVAILABLE
        and not torch.compiler.is_compiling()  # the compiler picks its own kernels
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and type(x) in (Tensor, nn.Parameter)  # not a subclass (DTensor, FakeTensor, ...)
        and type(weight) in (Tensor, nn.Parameter)
        and x.numel() >= MIN_ROWS * x.shape[-1]
        and not torch.is_autocast_enabled("cpu")
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, on oneDNN where that is faster (see the module docstring)."""
    if uses_onednn(x, weight):
        if not torch.is_grad_enabled():  # evaluation, sampling: nothing to save for backward
            return _forward(x, weight, bias)[1]
        return _OneDNNLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, init and state dict) with the oneDNN float32 CPU path."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def _forward(x: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """``x @ weight.T + bias`` for ``x`` of any leading shape on oneDNN; also the (N, in) rows of
    ``x`` it multiplied (a view unless ``x`` was not contiguous), which backward needs."""
    rows = x.reshape(-1, x.shape[-1])
    y = matmul_nt(rows, weight, bias)  # (N, out)
    return rows, y.view(*x.shape[:-1], weight.shape[0])


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        rows, y = _forward(x, weight, bias)
        ctx.save_for_backward(rows, weight)
        ctx.input_shape = x.shape
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y: Tensor):
        rows, weight = ctx.saved_tensors
        grad_rows = grad_y.reshape(-1, weight.shape[0])  # (N, out)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = matmul_nt(grad_rows, weight.t()).view(ctx.input_shape)  # (N, in)
        if ctx.needs_input_grad[1]:
            grad_w = weight_grad(grad_rows, rows)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_rows.sum(0)
        return grad_x, grad_w, grad_b
