"""Linear layers for fast CPU decoding (``minigpt.cpu.speed_up_decoding``; inference only: the
weight copy does not follow updates), each multiplying with a copy of its weight laid out for
one of ``KERNELS``: ``onednn``, oneDNN's blocked copy (float32 or bfloat16; eager decoding);
``plain``, ``F.linear`` on a copy in the weight dtype (AVX2-only CPUs have no oneDNN bfloat16);
``rowsum``, the (out, in) weight, whose one-row product inductor fuses into one streaming pass
inside a compiled decode step (a prompt's rows: ``prompt_product``). Activations stay float32.
``fuse_into_compiled_steps`` writes an attention's one-query step as products and sums inside a
compiled step only (SDPA's CPU kernel would split the compiled loops at every layer). Shape
letters: B batch, nh query heads, nkv key/value heads, L cached slots, hd head size, g query
heads per key/value head.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minigpt.cpu import onednn

KERNELS = ("onednn", "plain", "rowsum")
ROWSUM = "rowsum"  # the compiled step's layout
WIDEN_BYTES = 1 << 20  # rowsum outside the compiled step widens weights in blocks of this size
# How a row-sum layer multiplies several rows (a prompt): F.linear's x @ W.T or the transposed
# product W @ x.T, which MKL splits across threads along the weight's long side.
PROMPT_PRODUCTS = ("x @ W.T", "W @ x.T")


def prompt_product(weight_dtype: torch.dtype, threads: int | None = None) -> str:
    """The product of ``PROMPT_PRODUCTS`` a row-sum layer takes for a prompt's rows: ``W @ x.T``
    on several threads (its split across them is the faster) and for bfloat16 weights (widened
    block by block), ``x @ W.T`` on one thread in float32, where ``F.linear`` is the faster."""
    threads = torch.get_num_threads() if threads is None else threads
    return PROMPT_PRODUCTS[0] if threads == 1 and weight_dtype == torch.float32 \
        else PROMPT_PRODUCTS[1]


def matmul_packed(x: Tensor, packed: Tensor, bias: Tensor | None, kernel: str,
                  product: str = PROMPT_PRODUCTS[0]) -> Tensor:
    """``x @ W.T + bias`` for rows ``x`` (N, in) and ``packed``, a ``PackedLinear``'s copy of W.
    ``onednn`` and ``plain`` cast ``x`` to ``packed``'s dtype and return that dtype; ``rowsum``
    widens the weight to ``x``'s dtype instead (``bias`` in ``x``'s dtype too), returns ``x``'s,
    and multiplies several rows with ``product`` (one of ``PROMPT_PRODUCTS``)."""
    if kernel == ROWSUM:
        if x.shape[0] == 1:  # a decode step's product: one streaming pass over the weight
            return (_rowsum_one_row if torch.compiler.is_compiling() else
                    _compiled_one_row())(x, packed, bias)
        y = _rowsum_rows(x, packed, product)
        return y if bias is None else y + bias
    x = x.to(packed.dtype)
    if kernel == "plain":
        return F.linear(x, packed, bias)
    return onednn.linear(x, packed, bias)


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
    """``_rowsum_one_row`` compiled on its own (one graph per weight shape), for a one-row
    product outside a compiled step: eager GEMV kernels read the weight slower on some CPUs."""
    from minigpt.static_decoding import cpu_step_options

    call = torch.compile(_rowsum_one_row, dynamic=False, fullgraph=True,
                         options=cpu_step_options())
    return torch._dynamo.config.patch(recompile_limit=64)(call)


class PackedLinear(nn.Module):
    """``layer`` (an ``nn.Linear``) for inference, its ``Parameter`` objects kept (the state dict
    and tied weights unchanged), multiplying with a copy of its weight laid out for ``kernel``
    (one of ``KERNELS``) in ``weight_dtype``; inputs are cast to ``weight_dtype`` (``rowsum``:
    the weight is widened instead) and outputs back. ``product``: ``rowsum``'s for several rows."""

    def __init__(self, layer: nn.Linear, weight_dtype: torch.dtype = torch.float32,
                 kernel: str = "onednn", product: str = PROMPT_PRODUCTS[0]):
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"kernel={kernel!r} must be one of {KERNELS}")
        if kernel == "onednn" and weight_dtype == torch.bfloat16 and not onednn.packs_bfloat16():
            raise ValueError(f"kernel='onednn' with bfloat16 weights needs AVX-512 (BW, VL, DQ) "
                             f"or AVX-NE-CONVERT, and this CPU has {onednn.cpu_capability()}: "
                             "use kernel='plain' or 'rowsum'")
        if product not in PROMPT_PRODUCTS:
            raise ValueError(f"product={product!r} must be one of {PROMPT_PRODUCTS}")
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.weight, self.bias = layer.weight, layer.bias  # the state dict's keys
        self.weight_dtype, self.kernel, self.product = weight_dtype, kernel, product
        with torch.no_grad():
            weight = layer.weight.detach().to(weight_dtype)
            self._packed = onednn.pack(weight, weight_dtype) if kernel == "onednn" \
                else weight.contiguous()
            bias_dtype = torch.float32 if kernel == ROWSUM else weight_dtype
            self._bias = None if layer.bias is None else layer.bias.detach().to(bias_dtype)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)  # (N, in)
        y = matmul_packed(rows, self._packed, self._bias, self.kernel, self.product)  # (N, out)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weight_dtype={self.weight_dtype}, kernel={self.kernel}"
                + (f", product={self.product}" if self.kernel == ROWSUM else ""))


def one_query_attention(q: Tensor, keys: Tensor, values: Tensor,
                        mask: Tensor | None) -> Tensor:
    """``F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)`` for
    q (B, nh, 1, hd) over keys, values (B, nkv, L, hd) under ``mask`` (B or 1, 1, 1, L) bool
    (True = may attend, at least one per row; or None), in the inputs' type."""
    B, nh, _, hd = q.shape
    nkv = keys.shape[1]
    grouped = q.view(B, nkv, nh // nkv, 1, hd)  # (B, nkv, g, 1, hd)
    # Scores as a column (..., L, 1): the softmax and the weighted sum of values then run
    # along L, each head's keys and values read once, row by row, as they lie in the cache.
    scores = (grouped * keys.unsqueeze(2)).sum(-1, keepdim=True) * hd ** -0.5  # (B, nkv, g, L, 1)
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(-1), float("-inf"))  # mask (B|1, 1, 1, L, 1)
    weights = scores.softmax(dim=-2)
    out = (weights * values.unsqueeze(2)).sum(-2)  # (B, nkv, g, hd)
    return out.view(B, nh, 1, hd)


def fuse_into_compiled_steps(attention: nn.Module) -> bool:
    """Route ``attention``'s (a ``MultiHeadAttention``) one-query cached step inside a compiled
    step to ``one_query_attention``, patching the instance only; False if already patched."""
    cached = attention._cached_attention
    if getattr(cached, "fused_one_query", False):
        return False

    def cached_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None,
                         dropout_p: float) -> Tensor:
        if q.shape[2] == 1 and dropout_p == 0.0 and torch.compiler.is_compiling():
            return one_query_attention(q, keys, values, mask)
        return cached(q, keys, values, mask, dropout_p)

    cached_attention.fused_one_query = True
    attention._cached_attention = cached_attention
    return True
