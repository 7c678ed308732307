"""Document masking: in a packed row of documents (``document_ids`` (B, T) int, a run of equal
ids each), a query sees the keys of its own document up to itself (within the window, if any)
and positions restart at each document, so each document computes as if alone. CUDA runs
``flex_attention`` with a block mask, other devices SDPA with a (B, 1, T, T) mask.

Shape letters: B batch, nh query heads, nkv key/value heads, T tokens, hd head dim.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from minigpt.window import masked_attention, window_mask


def document_ids_of(idx: Tensor, bos_id: int) -> Tensor:
    """(B, T) int64 document ids of ``idx`` (B, T): each ``bos_id`` token begins a document; the
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
    """(B, T) int32 run numbers: 0 for a row's first document, +1 at each change of id (two
    separate runs of one id are different documents)."""
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
    the last ``window`` tokens (int or 0-dim tensor; None: any), not padded (``padding`` (B, T))."""
    seg = segments(document_ids)
    pos = torch.arange(seg.shape[1], device=seg.device)
    mask = (seg[:, :, None] == seg[:, None, :]) & window_mask(pos, pos, window)  # (B, T, T)
    if padding is not None:
        mask = mask & ~padding[:, None, :]
    return mask[:, None]  # (B, 1, T, T)


def document_attention(q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor,
                       window: int | Tensor | None, padding: Tensor | None, dropout_p: float,
                       sdpa) -> Tensor:
    """q (B, nh, T, hd) over k, v (B, nkv, T, hd) under ``document_mask`` -> (B, nh, T, hd); a
    query with no visible key gives zeros. ``sdpa``: the caller's (it handles nkv < nh)."""
    if q.is_cuda and dropout_p == 0.0:
        return flex_document_attention(q, k, v, document_ids, window, padding)
    return masked_attention(sdpa, q, k, v, document_mask(document_ids, window, padding), dropout_p)


def flex_document_attention(q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor,
                            window: int | Tensor | None, padding: Tensor | None,
                            compiled: bool = True) -> Tensor:
    """``document_attention`` through FlexAttention's block mask of the same rule; ``compiled``
    False runs its reference implementation (the CPU tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    B, nh, T, _ = q.shape
    if torch.compiler.is_compiling():
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
    """The last block mask built, reused while the very same inputs (held, unchanged) ask again:
    the layers of one forward pass share their batch's mask."""

    def __init__(self):
        self.inputs, self.versions, self.mask = None, None, None

    def get(self, build, *inputs):
        versions = [x._version if isinstance(x, Tensor) else None for x in inputs]
        if self.inputs is None or versions != self.versions \
                or not all(map(_same_input, self.inputs, inputs)):
            self.mask = build(*inputs)
            self.inputs, self.versions = inputs, versions
        return self.mask


def _same_input(a, b) -> bool:
    return a is b if isinstance(a, Tensor) or isinstance(b, Tensor) else a == b


_BLOCK_MASKS = _LastBlockMask()


@functools.cache
def _compiled_block_mask():
    """``_block_mask`` compiled once per process: eagerly it evaluates the rule on the whole
    (B, T, T) grid; compiled it never materializes it."""
    return torch.compile(_block_mask, dynamic=False)


@functools.cache
def _compiled_flex():
    """flex_attention compiled once per process (eager, it is a reference loop)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)
