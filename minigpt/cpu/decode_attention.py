"""A compiled CPU decode step's one-query attention written as products and sums, which
inductor fuses with the projections around it (SDPA's CPU kernel is a call out of the compiled
program that splits its loops at every layer). Eagerly SDPA is the faster, so the instance is
patched from outside to take this path only inside a compiled step.

Shape letters: B batch, nh query heads, nkv key/value heads, L cached slots, hd head size,
g query heads per key/value head.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


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
