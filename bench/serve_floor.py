"""The lowest p50 time to first token any engine could give requests that arrive together.

    python -m bench.serve_floor               # toy shape, bench.serve's 16 prompts, one thread
    python -m bench.serve_floor --clients 8 --arrival 0.75 --pace 0.14

Every prompt must be read before its first token, so the prompts' arithmetic bounds the median
first token of a burst. This times ``RunningBatch.prefill`` (the server's prompt read) over the
first k of ``bench.serve``'s prompts, k = 1 .. ``--clients``, on the model placed as the server
places it (interleaved, median of ``--repeats``), and searches every grouping of the prompts in arrival
order (a group of k is read in cost(k), once the engine is free and its last prompt has
arrived) for the lowest median first token: no contention, no decode steps, no HTTP
beyond ``--arrival`` ms in and ``--out`` ms back. Twice: all requests arriving at ``--arrival``,
and the first there then one every ``--pace`` ms. Each is also given as a ratio to one request
alone on the same terms (``--arrival`` + cost(1) + ``--out``), the quantity bench.serve's
first-token target bounds.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
from functools import partial
from pathlib import Path

import torch

from bench.serve import _prompts, _write_checkpoint
from bench.timing import medians, time_interleaved
from minigpt.devices import check_device, inference_dtype


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if not 1 <= args.clients <= 20:
        raise SystemExit(f"--clients={args.clients}: give 1..20 (every grouping is searched)")
    args.device = check_device(args.device)
    args.dtype = str(inference_dtype(args.dtype, args.device)).removeprefix("torch.")
    args.self_test, args.seed = False, 0
    torch.set_num_threads(args.threads)
    costs = _prompt_read_ms(args)
    alone = args.arrival + costs[0] + args.out
    print(f"{args.model} model on {args.device} ({args.dtype}), {args.threads} thread(s): ms to "
          f"read k of bench.serve's prompts in one pass, k = 1 .. {args.clients}: "
          f"{' '.join(f'{c:.2f}' for c in costs)}; one request alone: {alone:.2f} ms to its "
          "first token")
    for name, arrivals in [("all at once", [args.arrival] * args.clients),
                           (f"one every {args.pace} ms",
                            [args.arrival + args.pace * i for i in range(args.clients)])]:
        p50, groups = best_schedule(arrivals, costs, args.out)
        print(f"{args.clients} arriving {name}: best p50 first token {p50:.2f} ms = "
              f"{p50 / alone:.2f}x alone (prompts read in groups of {groups})")


def _prompt_read_ms(args) -> list[float]:
    """Median ms of one prefill of the first k prompts, k = 1 .. clients (timed interleaved)."""
    from minigpt.inference import load_for_inference
    from minigpt.serve.batch import RunningBatch

    with tempfile.TemporaryDirectory(prefix="bench-floor-") as tmp:
        loaded = load_for_inference(str(_write_checkpoint(Path(tmp) / "m.ckpt", args)),
                                    device=args.device, dtype=args.dtype)
    loaded.place()  # as the server places it (CPU speedups on)
    prompts = [loaded.tokenizer.encode(p) for p in _prompts(args.clients)]
    batch = RunningBatch(loaded.model, loaded.model.kv_cache_capacity(), args.clients)

    def read(k: int) -> None:
        logits, _ = batch.prefill(prompts[:k])
        logits.float().argmax(dim=-1).tolist()  # the first tokens, on the host

    with torch.inference_mode():
        times = time_interleaved({k: partial(read, k) for k in range(1, args.clients + 1)},
                                 args.warmup, args.repeats)
    return [1e3 * seconds for seconds in medians(times).values()]


def best_schedule(arrivals: list[float], costs: list[float],
                  out: float) -> tuple[float, list[int]]:
    """The lowest median first-token time over every split of the requests (in arrival order)
    into consecutive groups, a group of k read in one pass of ``costs[k - 1]``, and the group
    sizes that reach it."""
    best = (float("inf"), [])
    for cuts in itertools.product((False, True), repeat=len(arrivals) - 1):
        sizes, size = [], 1
        for cut in cuts:
            if cut:
                sizes.append(size)
                size = 0
            size += 1
        sizes.append(size)
        engine_free, first_tokens, start = 0.0, [], 0
        for size in sizes:
            engine_free = max(engine_free, arrivals[start + size - 1]) + costs[size - 1]
            first_tokens += [engine_free + out] * size
            start += size
        best = min(best, (statistics.median(first_tokens), sizes))
    return best


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="toy", help="configs/model/<name>.yaml's shape")
    parser.add_argument("--clients", type=int, default=16, help="requests in the burst (1..20)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=1, help="as bench.serve's server")
    parser.add_argument("--arrival", type=float, default=0.75,
                        help="ms from a client's send to its request reaching the engine")
    parser.add_argument("--pace", type=float, default=0.14,
                        help="ms between two requests of a burst reaching the engine")
    parser.add_argument("--out", type=float, default=0.1,
                        help="ms from a first token sampled to the client reading it")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    return parser


if __name__ == "__main__":
    main()
