"""BOS-aligned rows (``data.align=bos``) of a prepared dataset: how many rows, what share of its
training tokens in-order packing crops (document tails cut at a row's end), and how long
finding the document starts takes (once per run, at setup).

    python -m bench.bos_crop data/<name> --context 256 512 1024
"""

from __future__ import annotations

import argparse
import time

from bench.timing import print_header
from minigpt.data.bos import cropped_fraction, document_starts, packed_row_starts
from minigpt.data.epochs import window_rows
from minigpt.data.tokens import load_meta, open_tokens


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prepared", help="a prepared dataset directory, e.g. data/shakespeare")
    parser.add_argument("--context", type=int, nargs="+", default=[256, 512, 1024])
    args = parser.parse_args(argv)
    meta = load_meta(args.prepared)
    tokens = open_tokens(args.prepared, "train", meta)
    start = time.perf_counter()
    starts = document_starts(tokens, meta["tokenizer"]["eot_id"])
    seconds = time.perf_counter() - start
    print(f"{len(tokens):,} train tokens, {len(starts):,} documents (mean "
          f"{len(tokens) / len(starts):.1f} tokens), document starts found in {seconds:.2f} s\n")
    print_header(f"{'context':>8} {'windows':>9} {'BOS rows':>9} {'cropped':>8}")
    for T in args.context:
        rows = packed_row_starts(starts, len(tokens), T)
        print(f"{T:>8} {len(window_rows(len(tokens), T)):>9,} {len(rows):>9,} "
              f"{cropped_fraction(rows, len(tokens), T):>8.1%}")


if __name__ == "__main__":
    main()
