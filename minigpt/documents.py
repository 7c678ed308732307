"""Document masking: a packed row of several documents, each attending only to itself.

A training row of T tokens may hold several documents one after another. ``document_ids`` (B, T)
int say which document each token belongs to: a document is a run of equal ids along the row
(``document_ids_of`` makes them from the tokens: each BOS / end-of-text token begins a new one).
Under the document mask a query sees the keys of its own document up to itself (and within the
window, if any), and positions restart at 0 at each document's first token
(``document_positions``), so every document is computed as if it ran alone.

Kernels (``document_attention``): on CUDA, ``flex_attention`` with a block mask (fully masked
tiles are skipped; no (T, T) mask is stored); elsewhere, SDPA with a boolean (B, 1, T, T)
block-diagonal mask, the fastest correct CPU path measured (``python -m bench.document_mask``,
``bench/README.md``). Decoding with a KV cache is one document and never comes here.

Shape letters: B batch, nh query heads, nkv key/value heads, T tokens, hd head dim.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import Tensor

from minigpt.window import finite_rows


def document_ids_of(idx: Tensor, bos_id: int) -> Tensor:
    """(B, T) int64 document ids of token ids ``idx`` (B, T): each ``bos_id`` token (GPT-2's
    end-of-text, which llm.c's shards put at every document's start) begins a new document; the
    tokens before a row's first one are the tail of an earlier document (id 0)."""
    return (idx == bos_id).long().cumsum(dim=1)


def document_starts(document_ids: Tensor) -> Tensor:
    """(B, T) bool, True at each document's first token (a row's first token always)."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def document_positions(document_ids: Tensor) -> Tensor:
    """(B, T) int64 positions that restart at 0 at each document's first token."""
    T = document_ids.shape[1]
    index = torch.arange(T, device=document_ids.device).expand_as(document_ids)  # (B, T)
    start_index = torch.where(document_starts(document_ids), index, 0).cummax(dim=1).values
    return index - start_index


def segments(document_ids: Tensor) -> Tensor:
    """(B, T) int32 run numbers: 0 for a row's first document, +1 at each change of id, so two
    separate runs of one id are different documents (and no check needs a device sync)."""
    return document_starts(document_ids).int().cumsum(dim=1, dtype=torch.int32) - 1


def check_document_ids(document_ids, batch: int, tokens: int) -> None:
    """Raise a named ``ValueError`` unless ``document_ids`` is an integer (batch, tokens) tensor."""
    if not isinstance(document_ids, Tensor) or document_ids.shape != (batch, tokens) \
            or document_ids.is_floating_point() or document_ids.dtype == torch.bool:
        got = (f"{tuple(document_ids.shape)} {document_ids.dtype}"
               if isinstance(document_ids, Tensor) else type(document_ids).__name__)
        raise ValueError(f"document_ids must be an integer tensor of shape (batch, tokens)="
                         f"({batch}, {tokens}), got {got}")


def document_mask(document_ids: Tensor, window: int | Tensor | None,
                  padding: Tensor | None = None) -> Tensor:
    """(B, 1, T, T) bool, True where a query may attend to a key: same document, causal, within
    the last ``window`` tokens (an int or a 0-dim tensor: ``window_schedule``; None: any distance), not a padded key (``padding`` (B, T))."""
    seg = segments(document_ids)
    T = seg.shape[1]
    pos = torch.arange(T, device=seg.device)
    distance = pos[:, None] - pos[None, :]  # (T, T)
    allowed = distance >= 0 if window is None else (distance >= 0) & (distance < window)
    mask = (seg[:, :, None] == seg[:, None, :]) & allowed  # (B, T, T)
    if padding is not None:
        mask = mask & ~padding[:, None, :]
    return mask[:, None]  # (B, 1, T, T)


def document_attention(q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor,
                       window: int | Tensor | None, padding: Tensor | None, dropout_p: float,
                       sdpa) -> Tensor:
    """Attention of q (B, nh, T, hd) over k, v (B, nkv, T, hd) of the same tokens under the
    document mask (``document_mask``); returns (B, nh, T, hd). A query with no visible key (its
    own token padded) returns zeros. ``sdpa`` is the caller's ``scaled_dot_product_attention``
    (it handles nkv < nh); CUDA without dropout takes ``flex_document_attention``."""
    if q.is_cuda and dropout_p == 0.0:
        return flex_document_attention(q, k, v, document_ids, window, padding)
    mask, empty_rows = finite_rows(document_mask(document_ids, window, padding))
    y = sdpa(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    return y if empty_rows is None else y.masked_fill(empty_rows, 0.0)


def flex_document_attention(q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor,
                            window: int | Tensor | None, padding: Tensor | None,
                            compiled: bool = True) -> Tensor:
    """``document_attention`` through FlexAttention: a block mask from the same rule (tiles no
    query may see are skipped, nothing (T, T) is stored), a compiled kernel (``compiled``;
    False runs flex_attention's reference implementation, which the CPU tests use)."""
    from torch.nn.attention.flex_attention import flex_attention

    B, nh, T, _ = q.shape
    if torch.compiler.is_compiling():  # inside a compiled graph: built by compiled code
        block_mask = _block_mask(document_ids, window, padding, T, q.device)
    else:
        build = _compiled_block_mask() if compiled else _block_mask
        block_mask = _BLOCK_MASKS.get(build, document_ids, window, padding, T, q.device)
    attend = _compiled_flex() if compiled else flex_attention
    return attend(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != nh)


def _block_mask(document_ids: Tensor, window: int | Tensor | None, padding: Tensor | None,
                T: int, device: torch.device):
    """FlexAttention's block mask for ``document_attention``'s rule."""
    from torch.nn.attention.flex_attention import create_block_mask

    seg = segments(document_ids)
    keep = None if padding is None else ~padding

    def visible(b, h, q_idx, kv_idx):
        allowed = (seg[b, q_idx] == seg[b, kv_idx]) & (q_idx >= kv_idx)
        if window is not None:
            allowed = allowed & (q_idx - kv_idx < window)
        return allowed if keep is None else allowed & keep[b, kv_idx]

    return create_block_mask(visible, document_ids.shape[0], None, T, T, device=device)


class _LastBlockMask:
    """The last block mask built, reused while the same tensors ask again: every layer of one
    forward pass shares its batch's mask, so it is built once per forward, not once per layer.
    Held by weak reference, so a new batch (a new tensor, maybe at the old one's address) never
    matches a stale entry."""

    def __init__(self):
        self.key, self.mask = None, None

    @staticmethod
    def _same(ref, obj) -> bool:
        if obj is None or isinstance(obj, int):
            return ref == ("value", obj)
        return isinstance(ref, tuple) and ref[0] == "tensor" and ref[1]() is obj \
            and ref[2] == obj._version

    @staticmethod
    def _ref(obj):
        if obj is None or isinstance(obj, int):
            return ("value", obj)
        return ("tensor", weakref.ref(obj), obj._version)

    def get(self, build, document_ids, window, padding, T, device):
        """The mask ``build(document_ids, window, padding, T, device)`` made, or the last one
        if it was asked for with these very tensors."""
        if self.key is not None:
            ids_ref, window_ref, padding_ref, size = self.key
            if size == (T, device) and self._same(ids_ref, document_ids) \
                    and self._same(window_ref, window) and self._same(padding_ref, padding):
                return self.mask
        self.mask = build(document_ids, window, padding, T, device)
        self.key = (self._ref(document_ids), self._ref(window), self._ref(padding), (T, device))
        return self.mask


_BLOCK_MASKS = _LastBlockMask()


@functools.cache
def _compiled_block_mask():
    """``_block_mask`` compiled once per process: eagerly, create_block_mask evaluates the rule
    on the whole (B, T, T) grid, which costs as much as the attention it serves
    (bench/README.md); compiled, it never materializes the grid. One graph serves every batch of
    a shape (the ids are its inputs; an int window is a constant of it)."""
    return torch.compile(_block_mask, dynamic=False)


@functools.cache
def _compiled_flex():
    """flex_attention compiled once per process (eager flex_attention is a reference loop)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)
