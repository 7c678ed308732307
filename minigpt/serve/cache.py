"""The KV cache of a serving batch: ``minigpt.kv_cache.KVCache`` with rows that join and leave.

The cache is allocated once for the most rows it will hold; the rows in use are views of its
first rows, so rows join (``append_rows``, the rows of a prefill cache) and leave (``keep_rows``)
by copying their cached tokens within the buffers, never the whole capacity. The rows' streams
end together: a row that joins has the slots before its tokens as padding; the slots every row has
as padding are dropped when rows join and when the stream reaches the capacity
(``drop_leading_padding``), so positions never change. ``fixed_shape`` gives a fixed-shape cache
(``sliced=False``, for captured graphs: ``minigpt.serve.graphs``) over the same buffers, which
lends ``view``s of its first rows and slots.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
from torch import Tensor

from minigpt.kv_cache import KVCache, LayerCache


class FullBuffers(NamedTuple):
    """A ``BatchCache``'s buffers for all its rows; the fields of the same names view the rows
    in use."""

    keys: list[Tensor]
    values: list[Tensor]
    padding: Tensor
    visible: Tensor
    next_position: Tensor


class BatchCache(KVCache):
    """A ``KVCache`` (no ring) of at most ``batch_size`` rows, whose rows join and leave between
    steps; a sliced one starts with no rows in use."""

    def __init__(self, batch_size: int, *args, **kwargs):
        super().__init__(batch_size, *args, **kwargs)
        self.full = FullBuffers(self.keys, self.values, self.padding, self.visible,
                                self.next_position)
        if self.sliced:
            self._use_rows(0)

    @property
    def max_rows(self) -> int:
        return len(self.full.padding)

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value buffers: every row's, in use or not."""
        return sum(t.nbytes for t in self.full.keys + self.full.values)

    def _use_rows(self, count: int) -> None:
        """Make the first ``count`` rows of the buffers the rows in use (views)."""
        if count > self.max_rows:
            raise ValueError(f"a serving cache of {self.max_rows} rows cannot hold {count}")
        keys, values, padding, visible, next_position = self.full
        self.keys, self.values = [k[:count] for k in keys], [v[:count] for v in values]
        self.padding, self.visible = padding[:count], visible[:count]
        self.next_position = next_position[:count]

    def view(self, rows: int, slots: int) -> BatchCache:
        """This fixed-shape cache's first ``rows`` rows and ``slots`` slots, sharing its buffers
        (a write through either is seen by both): a step over fewer rows and tokens at the same
        addresses, while the stream holds fewer than ``slots`` tokens."""
        if self.sliced or self.ring:
            raise ValueError("view is for fixed-shape caches (sliced=False) without a ring")
        other = copy.copy(self)
        other.keys = [k[:rows, :, :slots] for k in self.keys]
        other.values = [v[:rows, :, :slots] for v in self.values]
        other.padding, other.visible = self.padding[:rows, :slots], self.visible[:rows, :slots]
        other.next_position = self.next_position[:rows]
        other.slot_pos = self.slot_pos[:slots]
        other.layers = [LayerCache(other, i) for i in range(len(self.keys))]
        return other

    def fixed_shape(self, rows: int) -> BatchCache:
        """A fixed-shape cache (``sliced=False``) over the first ``rows`` rows of this sliced
        cache's buffers and its stream's slots, sharing them: fixed-shape steps write where this
        cache reads, so rows pass between the two without a copy (``continue_from``,
        ``restart_stream``). Its keys and values start as zeros: a fixed-shape step weighs every
        slot of its view, the masked ones by 0, so none may hold a NaN."""
        if not self.sliced or self.ring or rows > self.max_rows:
            raise ValueError(f"a fixed-shape cache of {rows} rows needs a sliced cache of at "
                             f"least as many rows without a ring (this one: {self.max_rows})")
        other = copy.copy(self)  # the stream's slot_pos, seen and slot: the same tensors
        other.sliced = False
        keys, values, padding, visible, next_position = self.full
        other.full = FullBuffers([k[:rows] for k in keys], [v[:rows] for v in values],
                                 padding[:rows], visible[:rows], next_position[:rows])
        other.keys, other.values, other.padding, other.visible, other.next_position = other.full
        other.layers = [LayerCache(other, i) for i in range(len(other.keys))]
        for buffer in other.keys + other.values:
            buffer.zero_()
        return other

    def continue_from(self, cache: BatchCache) -> None:
        """Take up the stream of the sliced ``cache`` whose buffers this fixed-shape cache
        shares (``fixed_shape``): its rows in use, then spare rows, whose outputs nobody reads,
        from position 0 (a stale position would run past the context)."""
        self.next_position[len(cache.padding):] = 0
        self.restart_stream(cache.length)

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only ``rows`` (indices of the rows in use, in order), moved to the front."""
        if rows == list(range(len(rows))):  # the first rows: nothing moves
            self._use_rows(len(rows))
            return
        index, n = torch.tensor(rows, device=self.seen.device), self.length
        for buffer in self.keys + self.values:
            buffer[:len(rows), :, :n] = buffer[index, :, :n]
        self.padding[:len(rows)] = self.padding[index]
        self.next_position[:len(rows)] = self.next_position[index]
        self._use_rows(len(rows))
        self._padded = bool(self.padding[:, :n].any())

    def leading_padding(self) -> int:
        """Slots at the start of the stream that are padding in every row."""
        if self.length == 0 or len(self.padding) == 0:
            return self.length
        real = ~self.padding[:, :self.length]  # (B, n)
        return int(real.any(dim=0).int().argmax())

    def drop_leading_padding(self) -> None:
        """Move every row's cached tokens back by the slots that are padding in every row
        (``leading_padding``), as a batch that rows join and leave makes room at the end of its
        stream; positions are unchanged, so every row decodes as before. Sliced caches only."""
        lead = self.leading_padding()
        if lead > 0:
            self._move_tokens(lead, 0, self.length - lead)
            self.restart_stream(self.length - lead)

    def append_rows(self, other: KVCache) -> None:
        """Add ``other``'s rows (a prefill of new prompts, each at its own positions) after the
        rows in use: the padding every row in use has first is dropped, and all rows' tokens
        end together, at the longer of the two streams (the slots before a row's tokens are its
        padding)."""
        lead = self.leading_padding()
        kept, n = self.length - lead, other.length  # slots of tokens in each
        length, B, R = max(kept, n), len(self.padding), len(other.padding)
        if self.ring or other.ring or not self.sliced or length > self.capacity or B + R > self.max_rows:
            raise ValueError(f"a sliced cache of {self.max_rows} rows x {self.capacity} slots "
                             f"cannot take {R} rows of {n} tokens beside {B} rows of {kept}")
        self._move_tokens(lead, length - kept, kept)
        self._use_rows(B + R)
        start = length - n  # the new rows' first token
        for mine, theirs in zip(self.keys + self.values, other.keys + other.values, strict=True):
            mine[B:, :, :start] = 0  # padding: zeros, not stale values (a NaN poisons a softmax)
            mine[B:, :, start:length] = theirs[:, :, :n]
        self.padding[B:, :start] = True
        self.padding[B:, start:length] = other.padding[:, :n]
        self.padding[B:, length:] = False
        self.next_position[B:] = other.next_position
        self.restart_stream(length)

    def _move_tokens(self, start: int, to: int, count: int) -> None:
        """Move slots ``start .. start + count`` of the rows in use to ``to .. to + count``; the
        slots before them become padding (zeros: some were never written), those after empty."""
        if start == to:
            return
        for buffer in self.keys + self.values:
            buffer[:, :, to:to + count] = buffer[:, :, start:start + count].clone()
            buffer[:, :, :to] = 0
        moved = self.padding[:, start:start + count].clone()
        self.padding[:, :to] = True
        self.padding[:, to:to + count] = moved
        self.padding[:, to + count:] = False

    def restart_stream(self, length: int) -> None:
        """The stream holds slots ``0 .. length`` of every row, in order (also: take up the
        stream after the fixed-shape steps of a cache sharing these buffers)."""
        self.slot_pos.fill_(-1)
        self.slot_pos[:length] = torch.arange(length, device=self.slot_pos.device)
        self.seen.fill_(length)
        self._length = length
        self._padded = bool(self.padding[:, :length].any())  # steps without padding: no mask
