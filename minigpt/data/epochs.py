"""Which rows a process reads, and where its training stream is in checkpoints.

``data.sampling=epoch``: epoch ``e`` visits the fixed training rows in the order of
``numpy.random.default_rng([seed, e]).permutation``; the epochs end to end are one sequence, global
batch ``g`` its rows ``g * B * W .. (g + 1) * B * W - 1`` (B rows per process, W processes), process
``r`` taking the ``r``-th B. Checkpoints store the rows read (``rows_read``), so a run resumes at
the next row on any number of processes. ``ResumableBatches``: every data module's position.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator

import numpy as np

from minigpt.data.config import DataError


def window_rows(n_tokens: int, context_length: int) -> np.ndarray:
    """Starts of windows of ``context_length + 1`` tokens laid end to end (inputs never
    overlap): every token is some window's input once."""
    return np.arange(0, n_tokens - context_length, context_length, dtype=np.int64)


@functools.lru_cache(maxsize=4)
def _order(seed: int, epoch: int, n_rows: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n_rows)


def epoch_rows(seed: int, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The row starts at global ``positions`` of the epochs' sequence of ``rows``."""
    positions = np.asarray(positions, dtype=np.int64)
    epochs, within = np.divmod(positions, len(rows))
    out = np.empty(positions.shape, dtype=np.int64)
    for epoch in np.unique(epochs):
        at = epochs == epoch
        out[at] = rows[_order(seed, int(epoch), len(rows))[within[at]]]
    return out


def batch_positions(rows_read: int, batch_index: int, batch_size: int, rank: int,
                    world_size: int) -> np.ndarray:
    """Global positions of process ``rank``'s batch ``batch_index`` counted from ``rows_read``
    (rows the run had read when this stream started)."""
    first = rows_read + (batch_index * world_size + rank) * batch_size
    return np.arange(first, first + batch_size, dtype=np.int64)


def rank_batches(items: np.ndarray, rank: int, world_size: int, batch_size: int, unit: str,
                 fix: str) -> list[np.ndarray]:
    """Process ``rank``'s share of the validation ``items`` in batches: every process the same
    number (collectives stay in step), the last ``len(items) % world_size`` left out."""
    per_rank = len(items) // world_size
    if per_rank == 0:
        raise DataError(f"{len(items)} validation {unit}(s) cannot be shared by {world_size} "
                        f"processes; {fix}")
    mine = items[rank::world_size][:per_rank]
    return [mine[i:i + batch_size] for i in range(0, per_rank, batch_size)]


class ResumableBatches:
    """The position of a data module's endless training stream, as checkpoints store it.

    A subclass sets ``batch_size``, ``seed`` and ``world_size``, and defines ``_train_stream()``
    (its batches from ``start_batch`` on) and ``_settings()`` (what decides which batches it
    draws). ``load_state_dict()`` warns naming every setting that differs (the run goes on, but
    not with the batches the original would draw)."""

    start_batch = 0  # first training batch to draw; set from checkpoints on resume
    drawn = 0  # training batches train_batches() has handed out since start_batch
    rows_read = 0  # sampling=epoch: rows of the epochs' sequence read before start_batch
    older: dict = {}  # the settings of checkpoints written before a setting existed

    @property
    def batches_consumed(self) -> int:
        """Index of the next training batch: where a resumed run's stream starts."""
        return self.start_batch + self.drawn

    def train_batches(self) -> Iterator:
        """The endless training stream from ``start_batch``, counted in ``batches_consumed``.
        Its iterator is made here (a loader's draws its seed from torch's RNG), not later."""
        self.drawn = 0
        stream = self._train_stream()

        def counted():
            for batch in stream:
                self.drawn += 1
                yield batch

        return counted()

    def state_dict(self) -> dict:
        rows_read = self.rows_read + self.drawn * self.batch_size * self.world_size
        return {"batches_consumed": self.batches_consumed, "rows_read": rows_read,
                **self._settings()}

    def load_state_dict(self, state: dict) -> None:
        """Continue at the stored position."""
        self.start_batch, self.drawn = int(state["batches_consumed"]), 0
        # checkpoints from before epochs: every process had read batches_consumed batches
        self.rows_read = int(state.get("rows_read", self.start_batch * self.batch_size
                                       * self.world_size))
        state = {**self.older, **state}
        changed = [f"{k}: {state.get(k)} -> {v}" for k, v in self._settings().items()
                   if state.get(k) != v]
        if changed:
            warnings.warn(f"resuming with different data settings ({', '.join(changed)}): "
                          f"training continues at batch {self.start_batch}, but not with the "
                          "batches the original run would have drawn", stacklevel=2)

