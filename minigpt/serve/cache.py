"""The KV cache of a serving batch: ``minigpt.kv_cache.KVCache`` with rows that join and leave.

The rows' streams end together: a row that joins (``append_rows``, the rows of a prefill cache)
has the slots before its tokens as padding; the slots every row has as padding are dropped when
rows join and shifted out when the stream reaches the capacity (``drop_leading_padding``), so
positions never change. A fixed-shape cache (``sliced=False``) takes the rows of a sliced one in
place (``load``, for captured graphs: ``minigpt.serve.graphs``), gives them back
(``sliced_rows``) and lends ``view``s of its first rows and slots.
"""

from __future__ import annotations

import copy

import torch

from minigpt.kv_cache import KVCache, LayerCache


class BatchCache(KVCache):
    """A ``KVCache`` (sliced, no ring) whose rows join and leave between steps."""

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

    def load(self, other: KVCache) -> None:
        """Copy the rows and tokens of ``other`` (a sliced, non-ring cache with at most this
        one's rows and capacity) into this fixed-shape cache's first rows, in place: its
        buffers keep their addresses (a captured graph's). The rows after them hold padding."""
        n, B = other.length, len(other.padding)
        if self.sliced or other.ring or n > self.capacity or B > len(self.padding):
            raise ValueError(f"a fixed-shape cache of {len(self.padding)} rows x "
                             f"{self.capacity} slots cannot load {B} rows of {n} tokens")
        for mine, theirs in zip(self.keys + self.values, other.keys + other.values, strict=True):
            mine[:B, :, :n].copy_(theirs[:, :, :n])
        self.padding[:B, :n].copy_(other.padding[:, :n])
        self.padding[:B, n:] = False
        self.padding[B:] = True  # spare rows attend only to the tokens they are fed
        self.next_position[:B].copy_(other.next_position)
        self.next_position[B:] = 0
        self.slot_pos.fill_(-1)
        self.slot_pos[:n].copy_(other.slot_pos[:n])
        self.seen.fill_(n)
        self._length, self._padded = n, True

    def sliced_rows(self, count: int) -> BatchCache:
        """A new sliced cache holding copies of this cache's first ``count`` rows and their
        tokens (``load`` undone)."""
        n = int(self.seen)  # steps through ``view``s advance it on the device only
        other = self.rows(torch.arange(count, device=self.seen.device))
        other.sliced, other._length = True, n
        other._padded = bool(other.padding[:, :n].any())
        return other

    def leading_padding(self) -> int:
        """Slots at the start of the stream that are padding in every row."""
        if self.length == 0 or len(self.padding) == 0:
            return self.length
        real = ~self.padding[:, :self.length]  # (B, n)
        return int(real.any(dim=0).int().argmax())

    def drop_leading_padding(self) -> None:
        """Move every row's cached tokens back by the slots that are padding in every row
        (``leading_padding``), as a batch that rows join and leave (``minigpt.serve``) makes room
        at the end of its stream; positions are unchanged, so every row decodes as before. Only
        for a sliced, non-ring cache."""
        offset = self.leading_padding()
        if offset == 0:
            return
        if self.ring or not self.sliced:
            raise ValueError("only a sliced, non-ring KV cache drops its leading padding")
        for buffers in (self.keys, self.values):
            for i, buffer in enumerate(buffers):
                buffers[i] = buffer.roll(-offset, dims=2)
        length = self.length - offset
        self.padding = self.padding.roll(-offset, dims=1)
        self.padding[:, length:] = False  # slots yet to be written hold no stale padding
        self.slot_pos.fill_(-1)
        self.slot_pos[:length] = torch.arange(length, device=self.slot_pos.device)
        self.seen.fill_(length)
        self._length = length
        self._padded = bool(self.padding[:, :length].any())  # steps without padding: no mask

    def append_rows(self, other: KVCache) -> None:
        """Add ``other``'s rows (a prefill of new prompts, each at its own positions) after this
        cache's rows, in one copy: the padding every row of this cache has first is dropped,
        and all rows' tokens end together, at the longer of the two streams (the slots before a
        row's tokens are its padding). Only for sliced, non-ring caches."""
        lead = self.leading_padding()
        kept, n = self.length - lead, other.length  # slots of tokens in each
        length, B, R = max(kept, n), len(self.padding), len(other.padding)
        if self.ring or other.ring or not self.sliced or length > self.capacity:
            raise ValueError(f"a sliced, non-ring cache of {self.capacity} slots cannot take "
                             f"rows of {n} tokens beside rows of {kept}")
        mine, theirs = slice(length - kept, length), slice(length - n, length)
        for buffers, others in ((self.keys, other.keys), (self.values, other.values)):
            for i, (buffer, new) in enumerate(zip(buffers, others, strict=True)):
                rows = buffer.new_zeros((B + R, *buffer.shape[1:]))  # padding slots: zeros
                rows[:B, :, mine] = buffer[:, :, lead:self.length]
                rows[B:, :, theirs] = new[:, :, :n]
                buffers[i] = rows
        padding = self.padding.new_zeros(B + R, self.capacity)
        padding[:B, :mine.start] = True
        padding[:B, mine] = self.padding[:, lead:self.length]
        padding[B:, :theirs.start] = True
        padding[B:, theirs] = other.padding[:, :n]
        self.padding = padding
        self.visible = self.visible.new_zeros(B + R, self.capacity)
        self.next_position = torch.cat([self.next_position, other.next_position])
        self.slot_pos.fill_(-1)
        self.slot_pos[:length] = torch.arange(length, device=self.slot_pos.device)
        self.seen.fill_(length)
        self._length = length
        self._padded = bool(padding[:, :length].any())
