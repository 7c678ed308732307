"""Preallocated key/value caches for incremental decoding: one per attention layer.

``KVCache`` keeps every token (up to ``capacity``) in order. ``RingKVCache`` keeps the last
``capacity`` tokens only, for sliding-window attention: its memory stays flat however long the
generation runs. Both store what the layer attends with: ``num_kv_heads`` heads (fewer than the
query heads under grouped-query attention) of keys already rotated (rotary embeddings).

Shape letters: B batch, h cached heads, T new tokens, L visible keys, hd head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class KVCache:
    """Preallocated keys/values of one attention layer for incremental decoding.

    ``keys``/``values`` are (B, h, capacity, hd); the first ``length`` positions are filled.
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

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and value buffers."""
        return self.keys.nbytes + self.values.nbytes

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

    def append_with_positions(
        self, k: Tensor, v: Tensor, padding: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
        """``append``, plus each visible key's index in the token stream (L,): what a
        sliding-window mask is built from."""
        keys, values, visible_padding = self.append(k, v, padding)
        return keys, values, visible_padding, torch.arange(self.length, device=k.device)


@dataclass
class RingKVCache(KVCache):
    """The keys/values of the last ``capacity`` tokens, for sliding-window attention.

    Token ``i`` of the stream lives in slot ``i % capacity`` and overwrites the one that left
    the window; ``positions`` (capacity,) holds each slot's stream index (-1: empty). ``length``
    counts every token seen, so it grows past ``capacity`` while the buffers do not.
    """

    positions: Tensor | None = None

    @classmethod
    def empty(
        cls, batch_size: int, num_heads: int, capacity: int, head_dim: int, *, device=None, dtype=None
    ) -> RingKVCache:
        cache = super().empty(batch_size, num_heads, capacity, head_dim, device=device,
                              dtype=dtype)
        cache.positions = torch.full((capacity,), -1, dtype=torch.long, device=device)
        return cache

    def reset(self) -> None:
        super().reset()
        self.positions.fill_(-1)

    def append(self, k, v, padding):
        raise ValueError("a RingKVCache keeps the last tokens only: it serves sliding-window "
                         "attention (append_with_positions), not full causal attention")

    def append_with_positions(
        self, k: Tensor, v: Tensor, padding: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
        """Return the keys the T new queries may need (the cached ones, then the new ones),
        their padding and stream indices; keep the last ``capacity`` tokens.

        One new token (decoding) overwrites the oldest slot and attends over the buffer in place,
        in slot order (attention does not depend on the order of its keys)."""
        T, start = k.shape[2], self.length
        if T == 1:
            self._store(k, v, padding, start)
            n = min(self.length, self.capacity)
            visible_padding = self.padding[:, :n] if self.padded else None
            return self.keys[:, :, :n], self.values[:, :, :n], visible_padding, self.positions[:n]
        n = min(start, self.capacity)
        keys = torch.cat([self.keys[:, :, :n], k], dim=2)  # (B, h, n + T, hd)
        values = torch.cat([self.values[:, :, :n], v], dim=2)
        new_positions = torch.arange(start, start + T, device=k.device)
        positions = torch.cat([self.positions[:n], new_positions])  # (n + T,)
        visible_padding = None
        if self.padded or padding is not None:
            new_padding = padding if padding is not None else self.padding.new_zeros(k.shape[0], T)
            visible_padding = torch.cat([self.padding[:, :n], new_padding], dim=1)  # (B, n + T)
        self._store(k, v, padding, start)
        return keys, values, visible_padding, positions

    def _store(self, k: Tensor, v: Tensor, padding: Tensor | None, start: int) -> None:
        """Write the last ``capacity`` of the T new tokens into their slots: at most two
        contiguous runs (before and after the ring wraps), written with slices."""
        T = k.shape[2]
        first = start + T - min(T, self.capacity)  # stream index of the first token kept
        while first < start + T:
            slot = first % self.capacity
            n = min(start + T - first, self.capacity - slot)
            src = slice(first - start, first - start + n)
            self.keys[:, :, slot:slot + n] = k[:, :, src]
            self.values[:, :, slot:slot + n] = v[:, :, src]
            if n == 1:
                self.positions[slot] = first
            else:
                self.positions[slot:slot + n] = torch.arange(first, first + n, device=k.device)
            if padding is not None:
                self.padding[:, slot:slot + n] = padding[:, src]
                self.padded = True
            elif self.padded:  # the slots' previous tokens may have been padding
                self.padding[:, slot:slot + n] = False
            first += n
        self.length = start + T
