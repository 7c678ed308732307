"""BOS-aligned rows (``data.align=bos``): every training row starts at a document's first token.

A document begins at its BOS token (GPT-2's end-of-text: llm.c's shards put one before each
document; minigpt's prepared files put one after each, which is the same stream from the second
document on), and only there: the tokens before a stream's first BOS are skipped, as
modded-nanogpt's loader skips them (llm.c cuts its shards at a fixed size, so a shard after the
first begins mid-document). A row of T + 1 tokens from a document start holds that document
and, packed in order after it, the ones that follow; a document longer than the row is cut
there. Two packings (``data.packing``), neither with padding or ignored targets:

* ``in_order``: ``packed_row_starts`` lays rows end to end in stream order, each at the first
  document start at or after the previous row's end; ``cropped_fraction`` counts the tokens that
  fall between (the cut-off tails). Random rows draw their starts from ``row_pool``.
* ``best_fit`` (nanochat's): ``best_fit_rows`` fills each row with whole documents from a buffer
  of the next ``BEST_FIT_BUFFER`` in stream order, always the longest that still fits; only when
  none fits does it crop one (the shortest) to fill the row exactly. A row is then a list of
  token spans (``PackedRows``), gathered per batch; random rows draw row numbers.

Both are pure functions of the token stream, so a resumed run rebuilds the same rows.
``aligned_rows`` makes a split's rows and refuses a stream too few BOS tokens cut into
documents (its rows would hold under ``MIN_COVERAGE`` of it: a corpus without BOS tokens
would train on its first row again and again).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from minigpt.data.config import DataError

SCAN_CHUNK = 1 << 24  # tokens per vectorized scan of the memory map
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
    """Rows of ``context_length + 1`` tokens of whole documents, best fit (module docstring):
    the documents run from each of ``starts`` to the next (the last to ``n_tokens``); a last
    row the remaining documents cannot fill is left out."""
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
        held = len(rows) * T  # their inputs (as cropped_fraction counts)
    if held < MIN_COVERAGE * n:
        raise DataError(
            f"data.align=bos: {where} has {n:,} tokens but {len(starts):,} BOS tokens (id "
            f"{bos_id}, each starting a document), so its {len(rows):,} rows of context_length "
            f"+ 1 = {T + 1} tokens would hold {held / max(n, 1):.1%} of it (at least "
            f"{MIN_COVERAGE:.0%} needed): use data.align=window (rows cut anywhere), a smaller "
            f"context_length, or a corpus of many documents, each begun (llm.c shards) or ended "
            f"(prepared files) by that token")
    return pool, rows, packed
