"""Fast CPU decoding: linear layers whose weights are laid out for one row at a time.

Decoding one token at a time multiplies a vector by every weight matrix, so its speed is the
speed of reading the weights from memory, and that depends on the layout each kernel reads:

* ``plain``:  ``F.linear`` on ``nn.Linear``'s (out, in) weight (the layer is left as it is);
* ``mkl``:    PyTorch's default GEMM on an (in, out) copy of the weight;
* ``onednn``: oneDNN's linear on its own blocked copy of the weight (for bfloat16 weights, which
  halve the bytes read, the one eager kernel; activations stay float32);
* ``rowsum``: for a compiled decode step: the (out, in) weight, float32 or bfloat16, and a
  one-row product written as a multiply and a sum over each weight row, which inductor compiles
  into one streaming pass over the weight inside the step's own program (bfloat16 widened to
  float32 in registers); a one-row product outside a compiled step (the prompt's last
  position, eager steps) runs that loop compiled on its own, and several rows (the prompt) a
  GEMM on widened blocks of the weight (``x @ W.T`` or ``W @ x.T``, whichever
  ``measure_prompt`` found faster for the shape). Activations and sums stay float32
  throughout: the float32 model on rounded weights.

Which eager float32 layout reads fastest differs by CPU and shape (``bench/generate.py``), so
``measure_decoding`` times the first three on the model's own layers, in the model's order, so
that each weight comes from memory as it does while decoding (``minigpt.cpu.tuning`` keeps the
result). A compiled step takes ``rowsum`` on every layer, by rule: oneDNN's packed layouts
cannot be traced, and the compiled step over row-sum weights was the fastest decoder measured
(``bench/README.md``; per shape, faster than the traceable layouts at two threads, not on every
shape at one). ``PackedLinear.like(layer, kernel)`` keeps ``layer``'s ``Parameter`` objects (the
state dict and tied weights are unchanged) and multiplies with a copy made once: for inference
only, since the copy does not follow later weight updates.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minigpt.cpu.tuning import Timings, clock

DECODE_KERNELS = ("plain", "mkl", "onednn")  # the eager layouts ``measure_decoding`` times
ROWSUM = "rowsum"  # the compiled step's layout
WIDEN_BYTES = 1 << 20  # rowsum outside the compiled step widens weights in blocks of this size
# How a row-sum layer multiplies several rows (a prompt): F.linear's x @ W.T (the default) or the
# transposed product W @ x.T, which MKL splits across threads better on some CPUs (measured).
PROMPT_PRODUCTS = ("x @ W.T", "W @ x.T")
PROMPT_ROWS = 16  # the rows ``measure_prompt`` times: a short prompt


def decode_key(layer: nn.Linear) -> str:
    """The timings-file key of a float32 decoding layer's shape."""
    return f"decode float32 {layer.in_features}x{layer.out_features}"


def prompt_key(layer: nn.Linear, weight_dtype: torch.dtype) -> str:
    """The timings-file key of a row-sum layer's shape, for its product of a prompt's rows."""
    dtype = str(weight_dtype).removeprefix("torch.")
    return f"prompt {dtype} {layer.in_features}x{layer.out_features}"


def pack_weight(weight: Tensor, kernel: str, dtype: torch.dtype = torch.float32) -> Tensor:
    """``weight`` (out, in) in ``dtype`` and the layout ``kernel`` reads (see the module
    docstring); ``plain`` returns it unchanged."""
    w = weight.detach().to(dtype)
    if kernel == "plain":
        return w
    if kernel == ROWSUM:
        return w.contiguous()
    if kernel == "mkl":
        return w.t().contiguous()  # (in, out)
    return torch.ops.mkldnn._reorder_linear_weight(w, 1)  # blocked for one row; any count works


def matmul_packed(x: Tensor, packed: Tensor, bias: Tensor | None, kernel: str,
                  product: str = PROMPT_PRODUCTS[0]) -> Tensor:
    """``x @ W.T + bias`` for rows ``x`` (N, in) and ``packed = pack_weight(W, kernel)``. The
    eager layouts cast ``x`` to ``packed``'s dtype and return that dtype; ``rowsum`` widens the
    weight to ``x``'s dtype instead (``bias`` in ``x``'s dtype too), returns ``x``'s, and
    multiplies several rows with ``product`` (one of ``PROMPT_PRODUCTS``)."""
    if kernel == ROWSUM:
        if x.shape[0] == 1:  # a decode step's product: one streaming pass over the weight
            return (_rowsum_one_row if torch.compiler.is_compiling() else
                    _compiled_one_row())(x, packed, bias)
        y = _rowsum_rows(x, packed, product)
        return y if bias is None else y + bias
    x = x.to(packed.dtype)
    if kernel == "plain":
        return F.linear(x, packed, bias)
    if kernel == "mkl":
        return x @ packed if bias is None else torch.addmm(bias, x, packed)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _rowsum_rows(x: Tensor, packed: Tensor, product: str) -> Tensor:
    """Rows ``x`` (N, in) by a row-sum weight (out, in), as ``product`` says: (N, out)."""
    if product not in PROMPT_PRODUCTS:
        raise ValueError(f"product={product!r} must be one of {PROMPT_PRODUCTS}")
    if packed.dtype == x.dtype:
        blocks = (packed,)
    else:  # widened a block of rows at a time, so the widened copy stays in cache instead of
        # going to memory and back: the prompt costs a read of the narrow weight only
        rows = max(1, WIDEN_BYTES // (packed.shape[1] * x.element_size()))
        blocks = (block.to(x.dtype) for block in packed.split(rows))  # each just before use
    if product == "x @ W.T":
        parts = [F.linear(x, w) for w in blocks]  # (N, out rows) each
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    parts = [torch.mm(w, x.t()) for w in blocks]  # (out rows, N) each
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).t().contiguous()


def _rowsum_one_row(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """The row-sum product of one row ``x`` (1, in), written so that inductor fuses the widening,
    the products and the sums into one loop over the weight's rows: no widened copy of the
    weight, no GEMM call."""
    y = (packed.to(x.dtype) * x).sum(dim=-1).unsqueeze(0)  # (1, out)
    return y if bias is None else y + bias


@functools.cache
def _compiled_one_row():
    """``_rowsum_one_row`` compiled on its own, for a one-row product outside a compiled step
    (the prompt's last position, eager steps): eager GEMV kernels read the weight at about half
    the speed on some CPUs (bench/README.md). One graph per weight shape."""
    from minigpt.static_decoding import cpu_step_options

    call = torch.compile(_rowsum_one_row, dynamic=False, fullgraph=True,
                         options=cpu_step_options())
    return torch._dynamo.config.patch(recompile_limit=64)(call)


class PackedLinear(nn.Module):
    """``nn.Linear`` for inference, multiplying with a copy of its weight laid out for
    ``kernel`` in ``weight_dtype``; inputs are cast to ``weight_dtype`` (``rowsum``: the weight
    is widened to the input's dtype instead) and outputs back to the input's dtype."""

    def __init__(self, in_features: int, out_features: int, weight: nn.Parameter,
                 bias: nn.Parameter | None, weight_dtype: torch.dtype = torch.float32,
                 kernel: str = "onednn", product: str = PROMPT_PRODUCTS[0]):
        super().__init__()
        if kernel not in (*DECODE_KERNELS, ROWSUM) or (
                weight_dtype != torch.float32 and kernel not in ("onednn", ROWSUM)):
            raise ValueError(f"kernel={kernel!r} must be one of {(*DECODE_KERNELS, ROWSUM)} "
                             f"(onednn or rowsum for {weight_dtype} weights)")
        if product not in PROMPT_PRODUCTS:
            raise ValueError(f"product={product!r} must be one of {PROMPT_PRODUCTS}")
        self.in_features, self.out_features = in_features, out_features
        self.weight, self.bias = weight, bias  # the original Parameters: the state dict's keys
        self.weight_dtype, self.kernel = weight_dtype, kernel
        self.product = product  # rowsum's product of several rows (one of PROMPT_PRODUCTS)
        with torch.no_grad():
            self._packed = pack_weight(weight, kernel, weight_dtype)
            bias_dtype = torch.float32 if kernel == ROWSUM else weight_dtype
            self._bias = None if bias is None else bias.detach().to(bias_dtype)

    @classmethod
    def like(cls, layer: nn.Linear, weight_dtype: torch.dtype = torch.float32,
             kernel: str = "onednn", product: str = PROMPT_PRODUCTS[0]) -> PackedLinear:
        return cls(layer.in_features, layer.out_features, layer.weight, layer.bias, weight_dtype,
                   kernel, product)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)  # (N, in)
        y = matmul_packed(rows, self._packed, self._bias, self.kernel, self.product)  # (N, out)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weight_dtype={self.weight_dtype}, kernel={self.kernel}"
                + (f", product={self.product}" if self.kernel == ROWSUM else ""))


# Enough of each shape to time (more only cost start-up time): the first few layers of a shape,
# and the first rows of a very wide weight (the LM head). A pass over them still reads far more
# than a CPU's last-level cache holds, so each weight comes from memory as when decoding.
TIMED_LAYERS_PER_SHAPE = 4
MAX_TIMED_OUTPUTS = 8192


@torch.no_grad()
def measure_decoding(layers: list[nn.Linear], keys: list[str], sweeps: int = 5) -> Timings:
    """Seconds per one-row product of each kernel for the shapes ``keys`` (``decode_key``) of
    ``layers``: ``sweeps`` passes in the model's order over a few layers of each shape, each
    layer's kernels in turn; per layer the fastest pass, averaged over the shape's layers.
    Holds one copy of the timed weights per kernel meanwhile."""
    timed, counts = _timed_layers(layers, keys, decode_key)
    packed = {kernel: [pack_weight(weight, kernel) for _, weight, _ in timed]
              for kernel in DECODE_KERNELS}
    rows = {w.shape[1]: torch.ones(1, w.shape[1]) for _, w, _ in timed}
    calls = {kernel: [functools.partial(matmul_packed, rows[w.shape[1]], packed[kernel][i], bias,
                                        kernel)
                      for i, (_, w, bias) in enumerate(timed)] for kernel in DECODE_KERNELS}
    return _per_key_seconds(timed, counts, calls, sweeps)


@torch.no_grad()
def measure_prompt(layers: list[nn.Linear], keys: list[str], weight_dtype: torch.dtype,
                   sweeps: int = 5) -> Timings:
    """Seconds per product of ``PROMPT_ROWS`` rows by row-sum ``weight_dtype`` weights, each of
    ``PROMPT_PRODUCTS``, for the shapes ``keys`` (``prompt_key``) of ``layers``; timed as
    ``measure_decoding`` times its kernels, each product on its own copy of the weights."""
    timed, counts = _timed_layers(layers, keys,
                                  functools.partial(prompt_key, weight_dtype=weight_dtype))
    # A copy per product: one copy read right after the other product would come from cache.
    packed = {product: [pack_weight(w, ROWSUM, weight_dtype).clone() for _, w, _ in timed]
              for product in PROMPT_PRODUCTS}
    rows = {w.shape[1]: torch.randn(PROMPT_ROWS, w.shape[1]) for _, w, _ in timed}
    calls = {product: [functools.partial(matmul_packed, rows[w.shape[1]], packed[product][i], bias,
                                         ROWSUM, product)
                       for i, (_, w, bias) in enumerate(timed)] for product in PROMPT_PRODUCTS}
    return _per_key_seconds(timed, counts, calls, sweeps)


def _timed_layers(layers: list[nn.Linear], keys: list[str], key_of) -> tuple[list, dict]:
    """``[(key, weight, bias)]`` of the first ``TIMED_LAYERS_PER_SHAPE`` layers of each key in
    ``keys`` (``key_of(layer)``), in the model's order, at most ``MAX_TIMED_OUTPUTS`` rows
    each; and the count per key."""
    timed, counts = [], defaultdict(int)
    for layer in layers:
        key = key_of(layer)
        if key in keys and counts[key] < TIMED_LAYERS_PER_SHAPE:
            counts[key] += 1
            bias = None if layer.bias is None else layer.bias.detach()[:MAX_TIMED_OUTPUTS]
            timed.append((key, layer.weight.detach()[:MAX_TIMED_OUTPUTS], bias))
    return timed, counts


def _per_key_seconds(timed: list, counts: dict, calls: dict[str, list], sweeps: int) -> Timings:
    """Each candidate's seconds per key: ``calls[candidate][i]`` multiplies ``timed[i]``;
    ``sweeps`` passes over the layers after a warm-up pass, per layer the fastest, averaged
    over the key's layers."""
    best = {name: [float("inf")] * len(timed) for name in calls}
    now = clock()
    for _ in range(sweeps + 1):  # the first pass warms up
        for i in range(len(timed)):
            # One layer's candidates back to back: whatever else the machine runs at that
            # moment slows them alike; each copy is still read from memory (a whole pass over
            # the other weights lies between two reads of it).
            for name, layer_calls in calls.items():
                start = now()
                layer_calls[i]()
                best[name][i] = min(best[name][i], now() - start)
    sums: Timings = defaultdict(lambda: dict.fromkeys(calls, 0.0))
    for i, (key, _, _) in enumerate(timed):
        for name in calls:
            sums[key][name] += best[name][i] / counts[key]
    return dict(sums)
