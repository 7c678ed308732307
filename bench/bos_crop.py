"""BOS-aligned rows (``data.align=bos``) of a prepared dataset: how many rows each packing
(``data.packing``: in_order, best_fit) makes, what share of the training tokens no row holds
(cropped: document tails cut at a row's end, or the rest of a document best fit cropped), the
share of row tokens that are padding (none: both packings fill every row), and how long finding
the document starts and packing take (once per run, at setup).

    python -m bench.bos_crop data/<name> --context 256 512 1024
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.timing import print_header
from minigpt.data.bos import best_fit_rows, document_starts, packed_row_starts
from minigpt.data.epochs import window_rows
from minigpt.data.tokens import load_meta, open_tokens


def in_order_covered(rows: np.ndarray, n_tokens: int, context_length: int) -> int:
    """Tokens some in-order row holds (each row: T + 1 tokens from its start)."""
    held = np.zeros(n_tokens + 1, np.int64)
    np.add.at(held, rows, 1)
    np.add.at(held, rows + context_length + 1, -1)
    return int((np.cumsum(held)[:n_tokens] > 0).sum())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prepared", help="a prepared dataset directory, e.g. data/shakespeare")
    parser.add_argument("--context", type=int, nargs="+", default=[256, 512, 1024])
    args = parser.parse_args(argv)
    meta = load_meta(args.prepared)
    tokens = open_tokens(args.prepared, "train", meta)
    n = len(tokens)
    start = time.perf_counter()
    starts = document_starts(tokens, meta["tokenizer"]["eot_id"])
    seconds = time.perf_counter() - start
    print(f"{n:,} train tokens, {len(starts):,} documents (mean {n / len(starts):.1f} tokens), "
          f"document starts found in {seconds:.2f} s\n")
    print_header(f"{'context':>8} {'windows':>9} {'packing':>9} {'rows':>7} {'cropped':>8} "
                 f"{'padded':>7} {'pack s':>7}")
    for T in args.context:
        start = time.perf_counter()
        rows = packed_row_starts(starts, n, T)
        in_order_s = time.perf_counter() - start
        start = time.perf_counter()
        best = best_fit_rows(starts, n, T)
        best_s = time.perf_counter() - start
        for name, count, covered, took in (
                ("in_order", len(rows), in_order_covered(rows, n, T), in_order_s),
                ("best_fit", len(best), best.used_tokens(), best_s)):
            print(f"{T:>8} {len(window_rows(n, T)):>9,} {name:>9} {count:>7,} "
                  f"{1 - covered / n:>8.1%} {0:>7.1%} {took:>7.2f}")


if __name__ == "__main__":
    main()
