"""BOS-aligned rows (``data.align=bos``): every row of T + 1 tokens starts at a BOS token, a
document's first (the tokens before a stream's first BOS are skipped: an llm.c shard after the
first begins mid-document), packed without padding by ``data.packing``: ``in_order``
(``packed_row_starts``: the documents that follow, the last cut at the row's end) or ``best_fit``
(``best_fit_rows``, nanochat's). Pure functions of the token stream: a resumed run rebuilds the
same rows.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from minigpt.data.config import DataError
from minigpt.data.tokens import SCAN_CHUNK

BEST_FIT_BUFFER = 1000  # documents best fit chooses among (nanochat's buffer)
# The least share of a split its BOS-aligned rows must hold. Packing crops document tails
# (nanochat's best fit about a third on FineWeb); far less means few documents, not packing.
MIN_COVERAGE = 0.1


def document_starts(tokens, bos_id: int, chunk: int = SCAN_CHUNK) -> np.ndarray:
    """int64 offsets of every ``bos_id`` token in ``tokens`` (a memory map or ``ShardStream``),
    scanned ``chunk`` tokens at a time: the document starts (the module docstring)."""
    found = [np.zeros(0, np.int64)]
    for a in range(0, len(tokens), chunk):
        part = np.asarray(tokens[a:min(a + chunk, len(tokens))])
        found.append(np.flatnonzero(part == bos_id).astype(np.int64) + a)
    return np.concatenate(found)


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


def draw_rows(seed: int, rank: int, batch_index: int, batch_size: int,
              pool: np.ndarray) -> np.ndarray:
    """Start offsets of random training batch ``batch_index`` on ``rank``: ``batch_size``
    uniform draws from ``pool`` (document starts), a pure function of its arguments (as
    ``window_starts``, so a resumed run draws the same rows)."""
    rng = np.random.default_rng([seed, rank, batch_index])
    return pool[rng.integers(0, len(pool), size=batch_size)]


@dataclass(frozen=True)
class PackedRows:
    """Rows of ``context_length + 1`` tokens made of token spans: row ``r`` is the spans
    ``row_offsets[r]:row_offsets[r + 1]`` of (``span_starts``, ``span_lengths``), in order."""

    span_starts: np.ndarray  # int64 stream offset of each span (a document start)
    span_lengths: np.ndarray  # int64 tokens of each span
    row_offsets: np.ndarray  # int64 (rows + 1,): each row's first span

    def __len__(self) -> int:
        return len(self.row_offsets) - 1

    def token_index(self, rows: np.ndarray) -> np.ndarray:
        """(len(rows), T + 1) int64 stream offsets of the tokens of ``rows``, in row order."""
        rows = np.asarray(rows, dtype=np.int64)
        spans = np.concatenate([np.arange(self.row_offsets[r], self.row_offsets[r + 1])
                                for r in rows])
        starts, lengths = self.span_starts[spans], self.span_lengths[spans]
        # each token's offset: its span's start plus its place in the span
        before = np.cumsum(lengths) - lengths  # tokens of the earlier spans
        index = np.repeat(starts - before, lengths) + np.arange(lengths.sum())
        return index.reshape(len(rows), -1)

    def used_tokens(self) -> int:
        return int(self.span_lengths.sum())


def best_fit_rows(starts: np.ndarray, n_tokens: int, context_length: int,
                  buffer: int = BEST_FIT_BUFFER) -> PackedRows:
    """Rows of ``context_length + 1`` tokens filled from a buffer of the next ``buffer`` documents
    in stream order, always the longest that still fits; only when none fits is one (the
    shortest) cropped to fill the row. The documents run from each of ``starts`` to the next (the
    last to ``n_tokens``); a last row the remaining documents cannot fill is left out."""
    row = context_length + 1
    lengths = np.diff(np.append(starts, n_tokens)).astype(np.int64)
    waiting: list[tuple[int, int]] = []  # (length, document), sorted
    next_document = 0
    span_starts, span_lengths, row_offsets = [], [], [0]
    while True:
        room = row
        while room:
            while len(waiting) < buffer and next_document < len(starts):
                bisect.insort(waiting, (int(lengths[next_document]), next_document))
                next_document += 1
            if not waiting:
                break
            fits = bisect.bisect_right(waiting, (room, len(starts))) - 1  # the longest that fits
            length, document = waiting.pop(fits if fits >= 0 else 0)  # none: crop the shortest
            span_starts.append(int(starts[document]))
            span_lengths.append(min(length, room))
            room -= span_lengths[-1]
        if room:  # the stream ran out mid-row
            del span_starts[row_offsets[-1]:], span_lengths[row_offsets[-1]:]
            break
        row_offsets.append(len(span_starts))
    return PackedRows(np.asarray(span_starts, np.int64), np.asarray(span_lengths, np.int64),
                      np.asarray(row_offsets, np.int64))


def aligned_rows(tokens, bos_id: int, context_length: int, packing: str, where: str
                 ) -> tuple[np.ndarray, np.ndarray, PackedRows | None]:
    """``(pool, rows, packed)`` of one split's stream ``tokens``: the row starts random rows
    draw from, the rows packed in order (``packed_row_starts``) or by best fit (``packed``:
    then pool and rows are row numbers). A ``DataError`` naming ``where`` (e.g. "the train
    split of fineweb") and its BOS count when the rows hold under ``MIN_COVERAGE`` of it."""
    n, T = len(tokens), context_length
    starts = document_starts(tokens, bos_id)
    packed = None
    if packing == "best_fit":
        packed = best_fit_rows(starts, n, T)
        pool = rows = np.arange(len(packed))
        held = packed.used_tokens()
    else:
        pool = row_pool(starts, n, T)
        rows = packed_row_starts(starts, n, T)
        held = len(rows) * T  # their inputs
    if held < MIN_COVERAGE * n:
        raise DataError(
            f"data.align=bos: {where} has {n:,} tokens but {len(starts):,} BOS tokens (id "
            f"{bos_id}, each starting a document), so its {len(rows):,} rows of context_length "
            f"+ 1 = {T + 1} tokens would hold {held / max(n, 1):.1%} of it (at least "
            f"{MIN_COVERAGE:.0%} needed): use data.align=window (rows cut anywhere), a smaller "
            f"context_length, or a corpus of many documents, each begun (llm.c shards) or ended "
            f"(prepared files) by that token")
    return pool, rows, packed
