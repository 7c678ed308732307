"""The key/value cache of a model's layers for incremental decoding: one object, one write path.

Each layer has a key and a value buffer (B, h, S, hd) of ``h`` key/value heads (keys stored
rotated under rotary embeddings); token ``t`` of the stream goes to slot ``t % S``. The
bookkeeping the layers share (each slot's stream index, padding, each row's next position, the
token count as a device tensor) lives in ``KVCache``; ``minigpt.serve.cache`` extends it for a
batch whose rows join and leave between steps.

Shape letters: B batch, h cached heads, S slots, T new tokens, L visible keys, hd head dim.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from minigpt.window import window_mask

Context = tuple[Tensor, Tensor, "Tensor | None"]  # keys, values, mask a layer's queries attend with


class KVCache:
    """Keys/values of ``num_layers`` layers for ``batch_size`` rows, ``capacity`` tokens each.

    ``window``: the layers' sliding window (None: full attention); a cache of exactly ``window``
    slots is a ring. ``sliced``: a one-token step attends to the filled slots only (False: to all
    ``capacity`` slots under a mask, with fixed shapes). A forward calls ``advance(T)`` once,
    before its layers; layer ``i`` then writes through ``layers[i]``, which
    ``MultiHeadAttention.forward`` takes as its ``kv_cache``.
    """

    def __init__(self, batch_size: int, num_layers: int, num_heads: int, capacity: int,
                 head_dim: int, *, window: int | None = None, sliced: bool = True,
                 device=None, dtype=None):
        if window is not None and capacity > window:
            raise ValueError(f"a cache for window={window} holds at most {window} tokens, got "
                             f"capacity={capacity}; give capacity={window}")
        shape = (batch_size, num_heads, capacity, head_dim)
        # A sliced step reads written slots only: no need to zero megabytes per generation. The
        # fixed-shape step multiplies every slot (by weight 0 where masked): zeros, not NaNs.
        new = torch.empty if sliced else torch.zeros
        self.keys = [new(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.values = [new(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.window, self.sliced = window, sliced
        self.ring = window is not None and capacity == window
        long = {"dtype": torch.long, "device": device}
        self.slot_pos = torch.full((capacity,), -1, **long)  # each slot's stream index; -1 empty
        self.padding = torch.zeros(batch_size, capacity, dtype=torch.bool, device=device)
        self.seen = torch.zeros(1, **long)  # tokens written so far
        self.next_position = torch.zeros(batch_size, 1, **long)  # each row's next position
        self.slot = torch.zeros(1, **long)  # a one-token step's slot
        self.visible = torch.zeros(batch_size, capacity, dtype=torch.bool, device=device)
        self.layers = [LayerCache(self, i) for i in range(num_layers)]
        self._length: int | None = 0  # `seen` on the host (None: read it from the device)
        self._padded = False  # any padding cached: a python flag, so unpadded steps never sync
        self._step: tuple | None = None  # how this forward's tokens attend: see `advance`
        self._writes_due = 0  # layers yet to write this forward's keys/values

    @property
    def capacity(self) -> int:
        return self.slot_pos.shape[0]

    @property
    def length(self) -> int:
        """Tokens written since the last ``reset`` (a ring holds the last ``capacity``)."""
        if self._length is None:  # after fixed-shape steps, which never touch the host
            self._length = int(self.seen)
        return self._length

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and value buffers."""
        return sum(t.nbytes for t in self.keys + self.values)

    def tensors(self) -> list[Tensor]:
        """Every tensor the cache reads or writes in place (what a captured graph must keep)."""
        return [*self.keys, *self.values, self.slot_pos, self.padding, self.seen,
                self.next_position, self.slot, self.visible]

    def rows(self, index: Tensor) -> KVCache:
        """A new cache of rows ``index`` (R,) of this one (copies; this one is unchanged): one
        context's cache continued several ways, as multiple-choice scoring does."""
        other = copy.copy(self)  # the python state: length, flags, window
        other.keys = [k[index] for k in self.keys]  # (R, h, S, hd) each
        other.values = [v[index] for v in self.values]
        other.padding, other.visible = self.padding[index], self.visible[index]  # (R, S)
        other.next_position = self.next_position[index]  # (R, 1)
        other.slot_pos, other.seen, other.slot = (t.clone() for t in (self.slot_pos, self.seen,
                                                                     self.slot))
        other.layers = [LayerCache(other, i) for i in range(len(self.keys))]
        return other

    def reset(self) -> None:
        """Forget the cached tokens; the buffers are reused in place, not reallocated."""
        self._length, self._padded, self._writes_due = 0, False, 0
        self.slot_pos.fill_(-1)
        self.padding.zero_()
        self.seen.zero_()
        self.next_position.zero_()

    def next_positions(self, T: int) -> Tensor:
        """Positions (B, T) of T new tokens: each row continues from its last position."""
        return self.next_position + torch.arange(T, device=self.seen.device)

    def total_after(self, T: int) -> int | None:
        """Tokens seen once T more are written, for context checks; None on a fixed-shape
        one-token step (never read back from the device: its caller crops)."""
        return self.length + T if self.sliced or T > 1 else None

    def advance(self, T: int, padding: Tensor | None = None,
                position_ids: Tensor | None = None) -> Tensor:
        """Place T new tokens, once per forward and before any layer writes: their slots,
        stream indices, padding (B, T) and positions, the token count, and how every layer's
        queries attend. Returns the positions (B or 1, T): ``position_ids``, or each row's
        continuation after its cached tokens."""
        if position_ids is None:
            position_ids = self.next_positions(T)
            self.next_position.add_(T)
        else:
            self.next_position.copy_(position_ids[:, -1:] + 1)
        if T == 1:
            self._advance_one(padding)
        else:
            self._advance_chunk(T, padding)
        self._writes_due = self.num_layers
        return position_ids

    def _advance_chunk(self, T: int, padding: Tensor | None) -> None:
        """T > 1 new tokens: slots from the count on the host; a mask when tokens are cached."""
        start, S = self.length, self.capacity
        self._check_room(start + T)
        chunk = None
        if start > 0:  # after cached tokens: mask by stream index, built before any overwrite
            chunk = self._chunk_mask(start, T, padding)
        keep = min(T, S)  # a ring keeps the last S tokens
        new_pos = torch.arange(start + T - keep, start + T, device=self.seen.device)
        slots = new_pos % S
        self.slot_pos.index_copy_(0, slots, new_pos)
        self._write_padding(slots, None if padding is None else padding[:, T - keep:])
        self.seen.fill_(start + T)
        self._length = start + T
        self._step = (slots, keep, chunk)

    def _advance_one(self, padding: Tensor | None) -> None:
        """One new token: slot ``seen % S``, read and advanced on the device."""
        start = self.length if self.sliced else None  # fixed shapes: nothing read on the host
        if start is not None:
            self._check_room(start + 1)
        torch.remainder(self.seen, self.capacity, out=self.slot)
        self.slot_pos.index_copy_(0, self.slot, self.seen)
        self._write_padding(self.slot, padding)
        self.seen.add_(1)
        if start is None:  # the whole capacity, under the mask of the filled real slots
            torch.logical_and(self.slot_pos >= 0, ~self.padding, out=self.visible)
            self._length = None
            return
        self._length = start + 1
        n = min(start + 1, self.capacity)
        fresh = start == 0  # attends to itself alone: the layer's own path (even if padding)
        self._step = None if fresh else (n, ~self.padding[:, None, None, :n] if self._padded
                                         else None)

    def _check_room(self, tokens: int) -> None:
        if not self.ring and tokens > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} tokens but {tokens} were "
                             "requested; reset the cache or crop the sequence")

    def _write_padding(self, slots: Tensor, padding: Tensor | None) -> None:
        if padding is not None:
            self.padding.index_copy_(1, slots, padding)
            self._padded = True
        elif not self.sliced or self._padded:  # the slots' old tokens may have been padding
            self.padding.index_fill_(1, slots, False)

    def _chunk_mask(self, start: int, T: int, padding: Tensor | None) -> tuple[int, Tensor]:
        """(cached slots n, mask (B or 1, 1, T, n + T)) for T queries after ``start`` tokens
        over the cached keys (slot order) followed by their own."""
        n = min(start, self.capacity)
        query_pos = torch.arange(start, start + T, device=self.seen.device)
        key_pos = torch.cat([self.slot_pos[:n], query_pos])  # (n + T,)
        mask = window_mask(query_pos, key_pos, self.window)[None, None]  # (1, 1, T, n + T)
        if self._padded or padding is not None:
            new = padding if padding is not None else self.padding.new_zeros(len(self.padding), T)
            keys_padding = torch.cat([self.padding[:, :n], new], dim=1)  # (B, n + T)
            mask = mask & ~keys_padding[:, None, None, :]
        return n, mask

    def _write(self, layer: int, k: Tensor, v: Tensor) -> Context | None:
        """Store layer ``layer``'s new keys/values k, v (B, h, T, hd) in their slots; return the
        keys, values (B, h, L, hd) and mask (True = may attend; None: all) the T queries attend
        over, or None when nothing was cached before them (they attend among themselves)."""
        self._writes_due -= 1
        keys, values = self.keys[layer], self.values[layer]
        k, v = k.to(keys.dtype), v.to(values.dtype)  # autocast computes them in lower precision
        T = k.shape[2]
        if T == 1:
            keys.index_copy_(2, self.slot, k)
            values.index_copy_(2, self.slot, v)
            if not self.sliced:  # the whole buffer, as a captured graph needs
                return keys, values, self.visible[:, None, None, :]  # mask (B, 1, 1, S)
            if self._step is None:
                return None
            n, mask = self._step
            return keys[:, :, :n], values[:, :, :n], mask
        slots, keep, chunk = self._step
        context = None
        if chunk is not None:  # cached keys, then the new ones (read before a ring overwrites)
            n, mask = chunk
            context = (torch.cat([keys[:, :, :n], k], 2), torch.cat([values[:, :, :n], v], 2),
                       mask)
        keys.index_copy_(2, slots, k[:, :, T - keep:])
        values.index_copy_(2, slots, v[:, :, T - keep:])
        return context


class LayerCache:
    """One layer's view of a ``KVCache``: what ``MultiHeadAttention.forward`` writes into, after
    the model advanced the cache for the forward's tokens. A lone attention layer with a cache of
    one layer is its own model: its write advances that cache first."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    @property
    def advanced(self) -> bool:
        """The cache already holds this forward's tokens (the model advanced it)."""
        return self.cache._writes_due > 0

    def next_positions(self, T: int) -> Tensor:
        """Positions (B, T) of a lone layer's T new tokens (a model passes the ones it placed)."""
        assert not self.advanced, "the model passes the positions it advanced the cache with"
        return self.cache.next_positions(T)

    def total_after(self, T: int) -> int | None:
        """``KVCache.total_after`` for this forward's T tokens, counted once."""
        cache = self.cache
        if not self.advanced:
            return cache.total_after(T)
        return cache.length if cache.sliced or T > 1 else None

    def update(self, k: Tensor, v: Tensor, padding: Tensor | None = None,
               position_ids: Tensor | None = None) -> Context | None:
        """Write this layer's new keys/values (see ``KVCache._write``). ``padding`` and
        ``position_ids`` only matter to a lone layer's cache, which this write advances."""
        if not self.advanced:
            if self.cache.num_layers > 1:
                raise RuntimeError("a KV cache of several layers advances once per forward: "
                                   "call cache.advance(T) before the layers write (GPT does)")
            self.cache.advance(k.shape[2], padding, position_ids)
        return self.cache._write(self.index, k, v)
