"""A compiled CPU decode step's attention, fused into the step's own program.

A one-token step attends one query per head over the cached keys. SDPA's CPU kernel is a call
out of the compiled program with its own set-up (tens of microseconds a layer) that splits the
step's fused loops in two at every layer; written as products and sums, the same attention
becomes loops inductor fuses with the projections around it (``bench/README.md``: about 2 ms a
token for GPT-2 small). Eagerly (the prompt, an eager step) SDPA's kernel is the faster, so
``MultiHeadAttention`` calls this only inside a compiled step.

Shape letters: B batch, nh query heads, nkv key/value heads (nh a multiple of it: GQA), L cached
slots, hd head size, g query heads per key/value head.
"""

from __future__ import annotations

from torch import Tensor


def one_query_attention(q: Tensor, keys: Tensor, values: Tensor,
                        mask: Tensor | None) -> Tensor:
    """``F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)`` for
    q (B, nh, 1, hd) over keys, values (B, nkv, L, hd) under ``mask`` (B or 1, 1, 1, L) bool,
    True = may attend, with at least one True per row (or None): (B, nh, 1, hd), as multiplies
    and sums in the inputs' type."""
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
