"""Fused causal multi-head attention: the block the whole project is built around.

It keeps the constructor of the book's ``MultiHeadAttention`` (Raschka, *Build a Large Language
Model (From Scratch)*, ch. 3) and gives the same numbers for the same weights, but

* projects queries, keys and values with ONE ``nn.Linear(d_in, 3 * d_out)`` (one matmul, not three),
* calls ``torch.nn.functional.scaled_dot_product_attention`` with ``is_causal=True`` on the plain
  causal path, so no T x T mask is built or stored (flash / memory-efficient kernels can run),
* loads the book's unfused state dict (``W_query/W_key/W_value/out_proj`` and its ``mask`` buffer).

Shape letters used in comments:
    B batch, T new tokens, L keys visible (cached + new), nh heads, hd head dim, C = d_out = nh * hd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_BOOK_PROJECTIONS = ("W_query", "W_key", "W_value")


@dataclass
class KVCache:
    """Preallocated keys/values of one attention layer for incremental decoding.

    ``keys``/``values`` are (B, nh, capacity, hd); the first ``length`` positions are filled.
    ``padding`` (B, capacity) marks cached keys that are padding (left-padded prompts).
    """

    keys: Tensor
    values: Tensor
    padding: Tensor
    length: int = 0
    padded: bool = False  # a python flag, so the unpadded path never syncs with the device

    @classmethod
    def empty(
        cls, batch_size: int, num_heads: int, capacity: int, head_dim: int, *, device=None, dtype=None
    ) -> KVCache:
        shape = (batch_size, num_heads, capacity, head_dim)
        return cls(
            keys=torch.zeros(shape, device=device, dtype=dtype),
            values=torch.zeros(shape, device=device, dtype=dtype),
            padding=torch.zeros(batch_size, capacity, device=device, dtype=torch.bool),
        )

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def reset(self) -> None:
        """Forget the cached tokens; the buffers are reused, not reallocated."""
        self.length = 0
        self.padded = False
        self.padding.zero_()

    def append(
        self, k: Tensor, v: Tensor, padding: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Write T new keys/values after the cached ones; return all visible (L = length) keys,
        values and their padding mask (None if nothing cached is padding)."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(
                f"KV cache holds {self.capacity} tokens but {end} were requested; "
                "reset the cache or crop the sequence"
            )
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        if padding is not None:
            self.padding[:, start:end] = padding
            self.padded = True
        self.length = end
        visible_padding = self.padding[:, :end] if self.padded else None
        return self.keys[:, :, :end], self.values[:, :, :end], visible_padding


class MultiHeadAttention(nn.Module):
    """Causal multi-head self-attention with a fused QKV projection and PyTorch SDPA.

    Args (same names and order as the book's class):
        d_in: input features per token.
        d_out: output features per token; split evenly over ``num_heads``.
        context_length: the most tokens one forward pass may see.
        dropout: dropout probability on the attention weights (training mode only).
        num_heads: number of heads.
        qkv_bias: bias on the query/key/value projection.
        out_bias: bias on the output projection (the book and GPT-2 have one).
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
    ):
        super().__init__()
        problems = []
        for name, value in (("d_in", d_in), ("d_out", d_out), ("context_length", context_length),
                            ("num_heads", num_heads)):
            if not isinstance(value, int) or value <= 0:
                problems.append(f"{name}={value!r} must be a positive integer")
        if not problems and d_out % num_heads != 0:
            problems.append(f"d_out={d_out} must be divisible by num_heads={num_heads}")
        if not 0.0 <= float(dropout) < 1.0:
            problems.append(f"dropout={dropout} must be in [0, 1)")
        if problems:
            raise ValueError("; ".join(problems))

        self.d_in, self.d_out = d_in, d_out
        self.context_length = context_length
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.dropout = float(dropout)
        self.qkv = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)  # rows: [queries; keys; values]
        self.out_proj = nn.Linear(d_out, d_out, bias=out_bias)
        self.register_load_state_dict_pre_hook(_fuse_book_state_dict)

    def extra_repr(self) -> str:
        return (f"d_in={self.d_in}, d_out={self.d_out}, num_heads={self.num_heads}, "
                f"context_length={self.context_length}, dropout={self.dropout}")

    def forward(
        self, x: Tensor, key_padding_mask: Tensor | None = None, kv_cache: KVCache | None = None
    ) -> Tensor:
        """Attend causally over ``x`` (B, T, d_in) and return (B, T, d_out).

        ``key_padding_mask`` (B, T) bool is True where a token is padding (as in
        ``torch.nn.MultiheadAttention``); padded keys get no weight, and a query whose keys are all
        masked returns the output projection of zeros (finite, never NaN). With ``kv_cache`` the
        new tokens' keys/values are appended to it and the queries attend to everything cached.
        """
        q, k, v = self._project(x, key_padding_mask, kv_cache)
        offset = kv_cache.length if kv_cache is not None else 0
        padding = key_padding_mask
        if kv_cache is not None:
            k, v, padding = kv_cache.append(k, v, key_padding_mask)
        mask, empty_rows = _attention_mask(q.shape[2], k.shape[2], offset, padding)

        dropout_p = self.dropout if self.training else 0.0
        if mask is None:
            # Plain causal path: no T x T tensor; a decode step (T == 1) needs no mask at all.
            is_causal = q.shape[2] > 1
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
            if empty_rows is not None:
                y = y.masked_fill(empty_rows, 0.0)
        B, _, T, _ = y.shape
        y = y.transpose(1, 2).reshape(B, T, self.d_out)  # (B, T, C)
        return self.out_proj(y)

    def attention_weights(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """The softmax attention weights (B, nh, T, T) for inspection (no dropout, no cache).

        Computed explicitly on request only; ``forward`` never materializes them.
        """
        q, k, _ = self._project(x, key_padding_mask, None)
        T = q.shape[2]
        mask, empty_rows = _attention_mask(T, T, 0, key_padding_mask)
        if mask is None:
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        scores = (q @ k.transpose(-2, -1)) * self.head_dim**-0.5  # (B, nh, T, T)
        weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        if empty_rows is not None:
            weights = weights.masked_fill(empty_rows, 0.0)
        return weights

    def _project(
        self, x: Tensor, key_padding_mask: Tensor | None, kv_cache: KVCache | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        self._check_inputs(x, key_padding_mask, kv_cache)
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.num_heads, self.head_dim)  # (B, T, 3, nh, hd)
        # Unbind the (3) axis in place, then transpose: in backward the three gradients are
        # stacked straight into qkv's contiguous layout (permuting first costs one more copy).
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # 3 x (B, nh, T, hd)
        return q, k, v

    def _check_inputs(self, x: Tensor, key_padding_mask: Tensor | None, kv_cache: KVCache | None):
        if x.dim() != 3 or x.shape[-1] != self.d_in:
            raise ValueError(
                f"x must have shape (batch, tokens, d_in={self.d_in}), got {tuple(x.shape)}"
            )
        B, T, _ = x.shape
        check_context_fits(T + (kv_cache.length if kv_cache is not None else 0),
                           self.context_length)
        if key_padding_mask is not None:
            if key_padding_mask.shape != (B, T):
                raise ValueError(
                    f"key_padding_mask must have shape (batch, tokens)=({B}, {T}), "
                    f"got {tuple(key_padding_mask.shape)}"
                )
            if key_padding_mask.dtype != torch.bool:
                raise ValueError(
                    f"key_padding_mask must be bool (True = padding), got {key_padding_mask.dtype}"
                )


def check_context_fits(tokens: int, context_length: int) -> None:
    """Refuse more tokens than the model was built to see, naming the fix."""
    if tokens > context_length:
        raise ValueError(f"{tokens} tokens exceed context_length={context_length}; "
                         "crop the input to the last context_length tokens")


def _attention_mask(
    T: int, L: int, offset: int, padding: Tensor | None
) -> tuple[Tensor | None, Tensor | None]:
    """Boolean mask (True = may attend) for T queries at positions offset.. over L keys.

    Returns (None, None) when ``is_causal`` (or, for a single query, no mask) is exact, so the
    common path builds nothing. ``empty_rows`` (B, 1, T, 1) marks queries with no visible key;
    they are allowed one key to keep softmax finite and are zeroed afterwards.
    """
    if padding is None and offset == 0 and T == L:
        return None, None
    if padding is None and T == 1:
        return None, None
    device = padding.device if padding is not None else None
    query_pos = torch.arange(offset, offset + T, device=device)
    key_pos = torch.arange(L, device=device)
    mask = key_pos[None, :] <= query_pos[:, None]  # (T, L)
    mask = mask[None, None]  # (1, 1, T, L)
    if padding is None:
        return mask, None
    mask = mask & ~padding[:, None, None, :]  # (B, 1, T, L)
    empty_rows = ~mask.any(dim=-1, keepdim=True)  # (B, 1, T, 1)
    if empty_rows.any():
        mask = mask | empty_rows
        return mask, empty_rows
    return mask, None


def _fuse_book_state_dict(module, state_dict, prefix, *args) -> None:
    """Load-state-dict pre-hook: turn the book's unfused layout into our fused one in place.

    The book stores three ``Linear(d_in, d_out)`` projections and a ``mask`` buffer; we stack the
    projections row-wise into ``qkv`` (queries, keys, values) and drop the mask, which SDPA does
    not need.
    """
    state_dict.pop(prefix + "mask", None)
    for param in ("weight", "bias"):
        names = [f"{prefix}{proj}.{param}" for proj in _BOOK_PROJECTIONS]
        present = [name in state_dict for name in names]
        if any(present) and not all(present):
            missing = [n for n, ok in zip(names, present, strict=True) if not ok]
            raise KeyError(f"book-style state dict is missing {missing}")
        if all(present):
            state_dict[f"{prefix}qkv.{param}"] = torch.cat([state_dict.pop(n) for n in names], 0)
