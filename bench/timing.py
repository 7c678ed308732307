"""What the benchmarks share to time and report: the torch thread count and the clock a step is
timed with (``--clock cpu`` counts the main thread's CPU time, which other processes on a shared
machine cannot inflate), ``--warmup`` / ``--repeats``, variants timed interleaved, medians and
per-round ratios, and a table's header."""

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
_clock = time.perf_counter  # chosen by configure_timing()


def clock() -> float:
    return _clock()


def add_timing_arguments(parser: argparse.ArgumentParser, clock_note: str = "", *,
                         warmup: int | None = None, repeats: int | None = None) -> None:
    """``--threads`` and ``--clock``; ``--warmup`` and ``--repeats`` (rounds) when given a
    default."""
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="torch.set_num_threads (default: all cores)")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall",
                        help="wall: elapsed time; cpu: CPU time of the main thread, which other "
                        f"processes cannot inflate (needs --threads 1{clock_note})")
    if warmup is not None:
        parser.add_argument("--warmup", type=int, default=warmup,
                            help=f"untimed rounds first (default {warmup})")
    if repeats is not None:
        parser.add_argument("--repeats", type=int, default=repeats,
                            help=f"timed rounds; medians are reported (default {repeats})")


def configure_timing(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu measures one thread: use it with --threads 1")
    global _clock
    _clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)


def time_interleaved(runs: dict[str, Callable[[], object]], warmup: int, repeats: int, *,
                     sync: Callable[[], object] | None = None) -> dict[str, list[float]]:
    """Seconds of each run's call in every timed round. A round calls every run once, in turn,
    so machine noise and slow drifts hit all of them alike; ``warmup`` rounds go first, untimed.
    ``sync`` (e.g. ``torch.cuda.synchronize``) is called before the clock starts and stops."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(warmup + repeats):
        for name, run in runs.items():
            if sync is not None:
                sync()
            start = clock()
            run()
            if sync is not None:
                sync()
            if i >= warmup:
                times[name].append(clock() - start)
    return times


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(samples) for name, samples in times.items()}


def median_ratios(times: dict[str, list[float]], base: str) -> dict[str, float]:
    """Per run, the median over rounds of ``base``'s time / its time: the calls of a round ran
    back to back, so slow drifts in machine load cancel."""
    return {name: statistics.median(b / t for b, t in zip(times[base], samples, strict=True))
            for name, samples in times.items()}


def print_header(header: str) -> None:
    """A table's header line and a rule under it."""
    print(header)
    print("-" * len(header))
