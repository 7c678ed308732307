"""BOS-aligned rows (``data.align=bos``): every training row starts at a document's first token.

A document begins at its BOS token (GPT-2's end-of-text: llm.c's shards put one before each
document; minigpt's prepared files put one after each, which is the same stream from the second
document on) and at the stream's first token. A row of T + 1 tokens from a document start holds
that document and, packed in order after it, the ones that follow; a document longer than the
row is cut there. Packing is in stream order (no reordering, so no padding and no ignored
targets): ``packed_row_starts`` lays rows end to end, each at the first document start at or
after the previous row's end, and ``cropped_fraction`` counts the tokens that fall between
(the cut-off tails); random rows draw their starts from ``row_pool``.
"""

from __future__ import annotations

import numpy as np

SCAN_CHUNK = 1 << 24  # tokens per vectorized scan of the memory map


def document_starts(tokens, bos_id: int, chunk: int = SCAN_CHUNK) -> np.ndarray:
    """int64 offsets of every document start in ``tokens`` (a memory map or ``ShardStream``):
    0 and each ``bos_id`` token, scanned ``chunk`` tokens at a time."""
    found = [np.zeros(1, np.int64)]
    for a in range(0, len(tokens), chunk):
        part = np.asarray(tokens[a:min(a + chunk, len(tokens))])
        found.append(np.flatnonzero(part == bos_id).astype(np.int64) + a)
    return np.unique(np.concatenate(found))


def row_pool(starts: np.ndarray, n_tokens: int, context_length: int) -> np.ndarray:
    """The document starts a row of ``context_length + 1`` tokens fits after."""
    return starts[starts + context_length + 1 <= n_tokens]


def packed_row_starts(starts: np.ndarray, n_tokens: int, context_length: int) -> np.ndarray:
    """Rows end to end in stream order: each at the first document start at or after the
    previous row's last input token + 1 (its inputs never overlap the next row's)."""
    pool = row_pool(starts, n_tokens, context_length)
    rows, i = [], 0
    while i < len(pool):
        rows.append(pool[i])
        i = int(np.searchsorted(pool, pool[i] + context_length, side="left"))
    return np.asarray(rows, dtype=np.int64)


def cropped_fraction(rows: np.ndarray, n_tokens: int, context_length: int) -> float:
    """The share of the stream no row's inputs hold (document tails cut off, the end)."""
    return 1.0 - len(rows) * context_length / max(n_tokens, 1)


def draw_rows(seed: int, rank: int, batch_index: int, batch_size: int,
              pool: np.ndarray) -> np.ndarray:
    """Start offsets of random training batch ``batch_index`` on ``rank``: ``batch_size``
    uniform draws from ``pool`` (document starts), a pure function of its arguments (as
    ``window_starts``, so a resumed run draws the same rows)."""
    rng = np.random.default_rng([seed, rank, batch_index])
    return pool[rng.integers(0, len(pool), size=batch_size)]
