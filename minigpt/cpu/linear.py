"""A drop-in for ``nn.Linear`` whose float32 CPU matmuls run on oneDNN.

PyTorch multiplies float32 matrices on the CPU with MKL's SGEMM. On AMD CPUs MKL takes its AVX2
code path even where the CPU has AVX-512, while oneDNN (also inside PyTorch) picks kernels by the
CPU's features; on Intel CPUs the two are about even. ``bench/gemm.py`` measures both on the
machine at hand. So the forward pass and both backward matmuls of a float32 CPU layer go through
oneDNN (``minigpt.cpu.onednn.matmul_nt``, ``input @ weight.T + bias`` for 2-D operands):

* forward:      y  = x @ W.T + b     -> matmul_nt(x, W, b)
* input grad:   dx = dy @ W          -> matmul_nt(dy, W.T)
* weight grad:  dW = dy.T @ x        -> matmul_nt(dy.T, x.T), or its transpose

Each of the three runs on oneDNN only where ``minigpt.cpu.tuning`` measured it faster on this
CPU for the layer's shape (``OneDNNLinear.ops``); the others take ``torch.mm`` as ``F.linear``'s
autograd would. Everything else (CUDA, bfloat16/float16, autocast, ``torch.compile``, tensor
subclasses such as FSDP's DTensor, a handful of rows) takes ``F.linear`` unchanged.
``OneDNNLinear.like(layer)`` shares ``layer``'s ``Parameter`` objects, so swapping it in keeps
tied weights tied and the state dict unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minigpt.cpu.onednn import available, matmul_nt
from minigpt.cpu.tuning import Timings, fastest_seconds

MATMULS = ("forward", "input grad", "weight grad")  # a linear layer's three matmuls
# Training GEMMs are timed at this many rows (about a chunk of the LM-head loss) and the layer's
# full width: the input gradient of a wide layer (the LM head) sums over all its outputs, and a
# slice of them can rank the kernels the other way round.
TIMED_ROWS = 512

# Fewer rows than this: a matrix-vector-like product (decoding), where oneDNN's per-call setup
# for an unpacked weight costs more than it saves (minigpt.cpu.packed handles decoding).
MIN_ROWS = 8


def uses_onednn(x: Tensor, weight: Tensor) -> bool:
    """Whether ``linear(x, weight)`` takes the oneDNN path (see the module docstring)."""
    return (
        available()
        and not torch.compiler.is_compiling()  # the compiler picks its own kernels
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and type(x) in (Tensor, nn.Parameter)  # not a subclass (DTensor, FakeTensor, ...)
        and type(weight) in (Tensor, nn.Parameter)
        and x.numel() >= MIN_ROWS * x.shape[-1]
        and not torch.is_autocast_enabled("cpu")
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None,
           ops: frozenset[str] = frozenset(MATMULS)) -> Tensor:
    """``F.linear(x, weight, bias)``, with the matmuls named in ``ops`` (of ``MATMULS``) on
    oneDNN where that applies (see the module docstring)."""
    if ops and uses_onednn(x, weight):
        if not torch.is_grad_enabled():  # evaluation, sampling: nothing to save for backward
            return _forward(x, weight, bias, "forward" in ops)[1]
        return _OneDNNLinear.apply(x, weight, bias, ops)
    return F.linear(x, weight, bias)


class OneDNNLinear(nn.Linear):
    """``nn.Linear`` (same parameters, init and state dict) with the oneDNN float32 CPU path for
    the matmuls in ``ops``."""

    ops: frozenset[str]

    @classmethod
    def like(cls, layer: nn.Linear, ops=MATMULS) -> OneDNNLinear:
        """A layer computing ``layer``'s function with ``layer``'s own ``Parameter`` objects."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = layer.in_features, layer.out_features
        new.weight, new.bias = layer.weight, layer.bias
        new.ops = frozenset(ops)
        new.train(layer.training)
        return new

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, self.ops)

    def extra_repr(self) -> str:
        on = ", ".join(op for op in MATMULS if op in self.ops)
        return f"{super().extra_repr()}, oneDNN: {on or 'none'}"


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


def _forward(x: Tensor, weight: Tensor, bias: Tensor | None,
             onednn: bool = True) -> tuple[Tensor, Tensor]:
    """``x @ weight.T + bias`` for ``x`` of any leading shape (on oneDNN, else ``F.linear``);
    also the (N, in) rows of ``x`` it multiplied (a view unless ``x`` was not contiguous), which
    backward needs."""
    rows = x.reshape(-1, x.shape[-1])
    y = matmul_nt(rows, weight, bias) if onednn else F.linear(rows, weight, bias)  # (N, out)
    return rows, y.view(*x.shape[:-1], weight.shape[0])


def matmul_kernels(x: Tensor, w: Tensor, dy: Tensor) -> dict[str, dict[str, object]]:
    """A linear layer's three matmuls for rows ``x`` (N, in), weight ``w`` (out, in) and output
    gradient ``dy`` (N, out): ``{matmul: {"mkl": call, "onednn": call}}``, ``mkl`` being
    ``torch.mm`` on the strided views ``F.linear``'s autograd uses (what ``tuning`` and
    ``bench/gemm.py`` time)."""
    return {
        "forward": {"mkl": lambda: torch.mm(x, w.t()), "onednn": lambda: matmul_nt(x, w)},
        "input grad": {"mkl": lambda: torch.mm(dy, w), "onednn": lambda: matmul_nt(dy, w.t())},
        "weight grad": {"mkl": lambda: torch.mm(dy.t(), x), "onednn": lambda: weight_grad(dy, x)},
    }


def timed_shape(layer: nn.Linear, matmul: str) -> tuple[int, int, int, str]:
    """(rows, in, out, matmul) at which ``layer``'s ``matmul`` is timed."""
    return TIMED_ROWS, layer.in_features, layer.out_features, matmul


def train_key(layer: nn.Linear, matmul: str) -> str:
    """The timings-file key of ``layer``'s ``matmul`` in float32 training."""
    n, d_in, d_out, _ = timed_shape(layer, matmul)
    return f"train float32 {n}x{d_in}x{d_out} {matmul}"


def measure_matmuls(shapes: dict[str, tuple[int, int, int, str]], repeats: int = 3) -> Timings:
    """Seconds per call of both kernels for each key's (rows, in, out, matmul); operands of one
    shape are made once (from a private generator: the global seed is left alone)."""
    timings, operands = {}, {}
    for key, (n, d_in, d_out, matmul) in shapes.items():
        if (n, d_in, d_out) not in operands:
            g = torch.Generator().manual_seed(0)
            operands[(n, d_in, d_out)] = (torch.randn(n, d_in, generator=g),
                                          torch.randn(d_out, d_in, generator=g),
                                          torch.randn(n, d_out, generator=g))
        kernels = matmul_kernels(*operands[(n, d_in, d_out)])[matmul]
        timings[key] = fastest_seconds(kernels, repeats)
    return timings


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None,
                ops: frozenset[str]) -> Tensor:
        rows, y = _forward(x, weight, bias, "forward" in ops)
        ctx.save_for_backward(rows, weight)
        ctx.input_shape = x.shape
        ctx.has_bias = bias is not None
        ctx.ops = ops
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y: Tensor):
        rows, weight = ctx.saved_tensors
        grad_rows = grad_y.reshape(-1, weight.shape[0])  # (N, out)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = matmul_nt(grad_rows, weight.t()) if "input grad" in ctx.ops else \
                torch.mm(grad_rows, weight)  # (N, in)
            grad_x = grad_x.view(ctx.input_shape)
        if ctx.needs_input_grad[1]:
            grad_w = weight_grad(grad_rows, rows) if "weight grad" in ctx.ops else \
                torch.mm(grad_rows.t(), rows)  # (out, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_rows.sum(0)
        return grad_x, grad_w, grad_b, None
