"""Fused causal multi-head attention: the book's ``MultiHeadAttention`` (Raschka, *Build a Large
Language Model (From Scratch)*, ch. 3), same constructor and numbers, with ONE ``qkv`` projection
and ``scaled_dot_product_attention``; it loads the book's unfused state dict. Its variants are
keyword-only and off by default. ``forward`` is the only code that attends.

Shape letters: B batch, T new tokens, L keys visible (cached + new), nh heads, nkv key/value
heads, hd head dim, C = d_out = nh * hd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minigpt.documents import check_document_ids, document_attention, document_positions
from minigpt.kv_cache import KVCache, LayerCache
from minigpt.rope import apply_rope, check_rope_head_dim, check_rope_theta, rope_angles
from minigpt.window import banded_attention, check_window, masked_attention, window_mask

__all__ = ["KVCache", "MultiHeadAttention", "check_context_fits"]
_BOOK_PROJECTIONS = ("W_query", "W_key", "W_value")


class MultiHeadAttention(nn.Module):
    """Causal multi-head self-attention with a fused QKV projection and PyTorch SDPA.

    Args (the book's): ``d_in``, ``d_out`` (split over ``num_heads``), ``context_length`` (the
    most tokens one forward pass sees), ``dropout`` (on the attention weights), ``num_heads``,
    ``qkv_bias``. Keyword-only: ``out_bias`` (on the output projection, as GPT-2); the variants,
    off by default: ``num_kv_heads`` (grouped-query attention: each key/value head shared by
    ``num_heads // num_kv_heads`` query heads), ``rope`` (rotary positions, ``rope_theta``),
    ``window`` (each query sees its last ``window`` keys), ``scheduled_window`` (a window that
    ``set_window`` changes between steps without a recompile), ``qk_norm`` (RMS-normalized
    queries and keys, no gain, ``qk_norm_eps``).
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
        *,
        out_bias: bool = True,
        num_kv_heads: int | None = None,
        rope: bool = False,
        rope_theta: float = 10000.0,
        window: int | None = None,
        qk_norm: bool = False,
        qk_norm_eps: float = 1e-5,
        scheduled_window: bool = False,
    ):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        problems = _constructor_problems(d_in, d_out, context_length, num_heads, dropout,
                                         num_kv_heads, rope, rope_theta, window, qk_norm,
                                         qk_norm_eps)
        if problems:
            raise ValueError("; ".join(problems))

        self.d_in, self.d_out = d_in, d_out
        self.context_length = context_length
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = d_out // num_heads
        self.dropout = float(dropout)
        self.rope_theta = float(rope_theta) if rope else None  # None: no rotation
        self.window = window
        self.qk_norm_eps = float(qk_norm_eps) if qk_norm else None  # None: no QK-norm
        kv_features = num_kv_heads * self.head_dim
        # rows: [queries; keys; values]; 3 * d_out without grouping
        self.qkv = nn.Linear(d_in, d_out + 2 * kv_features, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out, bias=out_bias)
        self.register_load_state_dict_pre_hook(_fuse_book_state_dict)
        # not persistent: state dicts keep their keys; the schedule sets it from the step
        self.register_buffer("live_window", torch.tensor(context_length) if scheduled_window
                             else None, persistent=False)

    def set_window(self, window: int) -> None:
        """Attend within the last ``window`` tokens from now on (``scheduled_window`` layers; in
        place, so a compiled forward does not recompile)."""
        if self.live_window is None:
            raise ValueError("set_window needs a layer built with scheduled_window=True "
                             "(GPTConfig.window_schedule)")
        self.live_window.fill_(window)

    @property
    def current_window(self) -> int | Tensor | None:
        """The window this layer attends with now: the scheduled tensor, else ``window``."""
        return self.window if self.live_window is None else self.live_window

    @property
    def unbounded(self) -> bool:
        """Rotary positions and a window: a sequence may run past ``context_length``."""
        return self.rope_theta is not None and self.window is not None

    def extra_repr(self) -> str:
        variants = "".join(f", {name}={value}" for name, value, default in (
            ("num_kv_heads", self.num_kv_heads, self.num_heads),
            ("rope_theta", self.rope_theta, None), ("window", self.window, None),
            ("qk_norm_eps", self.qk_norm_eps, None))
            if value != default)
        return (f"d_in={self.d_in}, d_out={self.d_out}, num_heads={self.num_heads}, "
                f"context_length={self.context_length}, dropout={self.dropout}{variants}")

    def forward(
        self, x: Tensor, key_padding_mask: Tensor | None = None,
        kv_cache: LayerCache | None = None, position_ids: Tensor | None = None,
        value_embedding: Tensor | None = None, document_ids: Tensor | None = None,
    ) -> Tensor:
        """Attend causally over ``x`` (B, T, d_in) and return (B, T, d_out).

        ``key_padding_mask`` (B, T) bool, True at padding: padded keys get no weight; a query
        with none left gives the projection of zeros. ``kv_cache`` (a ``KVCache``'s
        ``layers[i]``): the new keys and values join it and the queries see it all.
        ``position_ids`` (B or 1, T): rope's positions (default: after the cached tokens).
        ``value_embedding`` (B, T, nkv * hd) is added to the new values. ``document_ids`` (B, T)
        int: each token attends within its own document, rope restarting at each; no cache.
        """
        q, k, v = self._project(x, key_padding_mask, kv_cache, document_ids)
        if value_embedding is not None:
            v = v + self._heads_of(value_embedding, x)
        if self.rope_theta is not None:  # rotary position embeddings (minigpt.rope)
            if position_ids is None:
                position_ids = self._positions(x, kv_cache, document_ids)
            q, k = self._rotate(q, k, position_ids)
        dropout_p = self.dropout if self.training else 0.0
        cached = None if kv_cache is None else kv_cache.update(k, v, key_padding_mask, position_ids)
        if cached is None:  # nothing cached before: the new tokens attend among themselves
            y = self._self_attention(q, k, v, key_padding_mask, dropout_p, document_ids)
        else:
            y = self._cached_attention(q, *cached, dropout_p)
        B, _, T, _ = y.shape
        y = y.transpose(1, 2).reshape(B, T, self.d_out)  # (B, T, C)
        return self.out_proj(y)

    def _positions(self, x: Tensor, kv_cache: LayerCache | None,
                   document_ids: Tensor | None) -> Tensor:
        """Rotary positions (1 or B, T) when none are given: after the cached tokens, from 0 at
        each document's start, or 0..T-1."""
        if kv_cache is not None:
            return kv_cache.next_positions(x.shape[1])
        if document_ids is not None:
            return document_positions(document_ids)
        return torch.arange(x.shape[1], device=x.device)[None]

    def _self_attention(self, q: Tensor, k: Tensor, v: Tensor, padding: Tensor | None,
                        dropout_p: float, document_ids: Tensor | None = None) -> Tensor:
        """T queries over their own T keys: within each document, banded for a window shorter
        than T, or full causal."""
        if document_ids is not None:
            return document_attention(q, k, v, document_ids, self.current_window, padding,
                                      dropout_p, self._sdpa)
        if self.window is not None and q.shape[2] > self.window:
            return banded_attention(q, k, v, self.window, padding, dropout_p, self._sdpa)
        if padding is None and self.live_window is None:
            # plain causal path: no T x T tensor; one query needs no mask at all
            return self._sdpa(q, k, v, dropout_p=dropout_p, is_causal=q.shape[2] > 1)
        positions = torch.arange(q.shape[2], device=q.device)
        mask = window_mask(positions, positions, self.live_window)  # (T, T)
        if padding is None:  # a scheduled window: every query sees itself, no row is empty
            return self._sdpa(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        mask = mask & ~padding[:, None, None, :]  # (B, 1, T, T)
        return masked_attention(self._sdpa, q, k, v, mask, dropout_p)

    def _cached_attention(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None,
                          dropout_p: float) -> Tensor:
        """T queries over the L keys a cache gave, under its ``mask`` (B or 1, 1, T, L). One new
        token always sees itself, so only a chunk's rows can be empty."""
        if mask is None or q.shape[2] == 1:
            return self._sdpa(q, keys, values, attn_mask=mask, dropout_p=dropout_p)
        return masked_attention(self._sdpa, q, keys, values, mask, dropout_p)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False) -> Tensor:
        """``F.scaled_dot_product_attention`` for q (..., nh, T, hd) and k, v (..., nkv, L, hd)."""
        if self.num_kv_heads == self.num_heads:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                                  dropout_p=dropout_p, is_causal=is_causal)
        *batch, nh, T, hd = q.shape
        if T == 1 and not is_causal:
            # decoding: a group's query heads become queries of its key/value head, so the
            # cached keys are read once per group (enable_gqa repeats them per head)
            grouped = q.reshape(*batch, self.num_kv_heads, nh // self.num_kv_heads, hd)
            return F.scaled_dot_product_attention(grouped, k, v, attn_mask=attn_mask,
                                                  dropout_p=dropout_p).view(q.shape)
        # enable_gqa: the kernels read each key/value head for its group, no copies
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, enable_gqa=True)

    def attention_weights(self, x: Tensor, key_padding_mask: Tensor | None = None,
                          position_ids: Tensor | None = None) -> Tensor:
        """The softmax attention weights (B, nh, T, T), for inspection only (no dropout, no
        cache; ``forward`` never materializes them)."""
        q, k, _ = self._project(x, key_padding_mask, None)
        if self.rope_theta is not None:
            q, k = self._rotate(q, k, self._positions(x, None, None) if position_ids is None
                                else position_ids)
        k = k.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)  # (B, nh, T, hd)
        positions = torch.arange(q.shape[2], device=x.device)
        mask = window_mask(positions, positions, self.current_window)  # (T, T)
        if key_padding_mask is not None:
            mask = mask & ~key_padding_mask[:, None, None, :]  # (B, 1, T, T)
        scores = (q @ k.transpose(-2, -1)) * self.head_dim**-0.5  # (B, nh, T, T)
        # a query with no visible key: a softmax over -inf only is NaN, its weights zeros
        return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).nan_to_num(0.0)

    def _project(
        self, x: Tensor, key_padding_mask: Tensor | None, kv_cache: LayerCache | None,
        document_ids: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Queries (B, nh, T, hd), keys and values (B, nkv, T, hd) of ``x``, QK-normalized when
        asked: ``forward`` and ``attention_weights`` both get them from here."""
        self._check_inputs(x, key_padding_mask, kv_cache, document_ids)
        B, T, _ = x.shape
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        if nkv == nh:
            qkv = self.qkv(x).view(B, T, 3, nh, hd)  # (B, T, 3, nh, hd)
            # unbind, then transpose: backward stacks the gradients straight into qkv's layout
            q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # 3 x (B, nh, T, hd)
        else:
            qkv = self.qkv(x).view(B, T, nh + 2 * nkv, hd)  # (B, T, nh + 2 nkv, hd)
            q, k, v = (t.transpose(1, 2) for t in qkv.split([nh, nkv, nkv], dim=2))
        if self.qk_norm_eps is not None:  # before rope, which keeps the length: rope stays last
            q = F.rms_norm(q, (hd,), eps=self.qk_norm_eps)
            k = F.rms_norm(k, (hd,), eps=self.qk_norm_eps)
        return q, k, v

    def _heads_of(self, value_embedding: Tensor, x: Tensor) -> Tensor:
        """(B, T, nkv * hd) -> (B, nkv, T, hd), the values' layout; a wrong shape is named."""
        B, T, _ = x.shape
        shape = (B, T, self.num_kv_heads * self.head_dim)
        if value_embedding.shape != shape:
            raise ValueError(f"value_embedding must have shape (batch, tokens, kv features)="
                             f"{shape}, got {tuple(value_embedding.shape)}")
        return value_embedding.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)

    def _rotate(self, q: Tensor, k: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = rope_angles(position_ids, self.head_dim, self.rope_theta)  # (B, 1, T, hd/2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def _check_inputs(self, x: Tensor, key_padding_mask: Tensor | None,
                      kv_cache: LayerCache | None, document_ids: Tensor | None):
        if x.dim() != 3 or x.shape[-1] != self.d_in:
            raise ValueError(f"x must have shape (batch, tokens, d_in={self.d_in}), got "
                             f"{tuple(x.shape)}")
        B, T, _ = x.shape
        if kv_cache is not None and kv_cache.cache.window != self.window:
            raise ValueError(f"this KV cache was built for window={kv_cache.cache.window}, the "
                             f"layer attends with window={self.window}; build it with the layer's "
                             "window")
        if document_ids is not None:
            if kv_cache is not None:
                raise ValueError("document_ids cannot be given with a KV cache: decoding is one "
                                 "document; pass document_ids=None")
            check_document_ids(document_ids, B, T)
        tokens = T if kv_cache is None else kv_cache.total_after(T)
        if not self.unbounded and tokens is not None:
            check_context_fits(tokens, self.context_length)
        if key_padding_mask is not None:
            if key_padding_mask.shape != (B, T):
                raise ValueError(f"key_padding_mask must have shape (batch, tokens)=({B}, {T}), "
                                 f"got {tuple(key_padding_mask.shape)}")
            if key_padding_mask.dtype != torch.bool:
                raise ValueError(f"key_padding_mask must be bool (True = padding), got "
                                 f"{key_padding_mask.dtype}")


def _constructor_problems(d_in, d_out, context_length, num_heads, dropout, num_kv_heads, rope,
                          rope_theta, window, qk_norm, eps) -> list[str]:
    """Problems with the book's arguments, then (once those are valid) the variant keywords."""
    problems = [f"{name}={value!r} must be a positive integer" for name, value in (
        ("d_in", d_in), ("d_out", d_out), ("context_length", context_length),
        ("num_heads", num_heads)) if not isinstance(value, int) or value <= 0]
    if not problems and d_out % num_heads != 0:
        problems.append(f"d_out={d_out} must be divisible by num_heads={num_heads}")
    if not 0.0 <= float(dropout) < 1.0:
        problems.append(f"dropout={dropout} must be in [0, 1)")
    if problems:
        return problems
    problems = [check_kv_heads(num_kv_heads, num_heads), check_window(window)]
    if rope:
        problems += [check_rope_head_dim(d_out // num_heads), check_rope_theta(rope_theta)]
    if not isinstance(qk_norm, bool):
        problems.append(f"qk_norm={qk_norm!r} must be true or false")
    elif qk_norm and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0):
        problems.append(f"qk_norm_eps={eps!r} must be a positive number")
    return [p for p in problems if p]


def check_kv_heads(num_kv_heads, num_heads) -> str | None:
    """The problem with ``num_kv_heads`` key/value heads for ``num_heads`` query heads, or None."""
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) \
            or not isinstance(num_heads, int) or not 1 <= num_kv_heads <= max(num_heads, 1):
        return f"num_kv_heads={num_kv_heads!r} must be an integer in [1, num_heads={num_heads}]"
    if num_heads % num_kv_heads:
        return f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}"
    return None


def check_context_fits(tokens: int, context_length: int) -> None:
    """Refuse more tokens than the model was built to see, naming the fix."""
    if tokens > context_length:
        raise ValueError(f"{tokens} tokens exceed context_length={context_length}; "
                         "crop the input to the last context_length tokens")


def _fuse_book_state_dict(module, state_dict, prefix, *args) -> None:
    """Load-state-dict pre-hook: the book's three projections stacked row-wise into ``qkv``
    (queries, keys, values), its ``mask`` buffer dropped (SDPA needs none)."""
    state_dict.pop(prefix + "mask", None)
    for param in ("weight", "bias"):
        names = [f"{prefix}{proj}.{param}" for proj in _BOOK_PROJECTIONS]
        present = [name in state_dict for name in names]
        if any(present) and not all(present):
            missing = [n for n, ok in zip(names, present, strict=True) if not ok]
            raise KeyError(f"book-style state dict is missing {missing}")
        if all(present):
            state_dict[f"{prefix}qkv.{param}"] = torch.cat([state_dict.pop(n) for n in names], 0)
