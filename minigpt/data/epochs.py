"""Every token once per epoch (``data.sampling=epoch``): the training rows in a seeded order.

The rows are fixed (windows end to end from offset 0, or BOS-aligned rows packed in order:
``minigpt.data.bos.packed_row_starts``); epoch ``e`` visits all of them in the order of
``numpy.random.default_rng([seed, e]).permutation``. The epochs laid end to end are one global
sequence of rows, and global batch ``g`` is its rows ``g * B * W .. (g + 1) * B * W - 1`` (B rows
per process, W processes), process ``r`` taking the ``r``-th B of them: the processes' rows are
disjoint, and together they read the sequence in order. A checkpoint stores how many rows of it
were read (``rows_read``), so a run resumes at the next row on any number of processes.
"""

from __future__ import annotations

import functools

import numpy as np


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
