"""Timing options shared by the benchmarks: the torch thread count and the clock a step is
timed with (``--clock cpu`` counts the main thread's CPU time, which other processes on a shared
machine cannot inflate)."""

import argparse
import os
import time

import torch

CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
_clock = time.perf_counter  # chosen by configure_timing()


def clock() -> float:
    return _clock()


def add_timing_arguments(parser: argparse.ArgumentParser, clock_note: str = "") -> None:
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="torch.set_num_threads (default: all cores)")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall",
                        help="wall: elapsed time; cpu: CPU time of the main thread, which other "
                        f"processes cannot inflate (needs --threads 1{clock_note})")


def configure_timing(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu measures one thread: use it with --threads 1")
    global _clock
    _clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)


def print_header(header: str) -> None:
    """A table's header line and a rule under it."""
    print(header)
    print("-" * len(header))
