"""Preparation throughput: ``prepare_dataset`` (data=shakespeare, GPT-2 BPE) vs a plain loop.

    TIKTOKEN_CACHE_DIR=../shared/tiktoken-cache python -m bench.prepare
    python -m bench.prepare --repeats 7 --no-memory

Variants, timed interleaved in this process after one warm-up round, median of ``--repeats``:
- ``loop``: nanoGPT's prepare.py shape: ``enc.encode_ordinary`` per play in one thread, an eot
  after each, ``np.array(ids, uint16).tofile(...)``. It starts from the plays already converted to
  plain text (that conversion is not timed for it).
- ``loop+read``: the same, starting like the pipeline from the installed package: reading and
  converting the Markdown (``read_plays``) is timed too. Same inputs and outputs as the pipeline.
- ``pipeline``: ``prepare_dataset`` end to end into a fresh temporary data root every run (so the
  idempotence check never short-circuits and nothing is reused): it also reads and converts the
  Markdown, tokenizes through ``datasets.map`` (tiktoken threads), writes train/val and meta.json.
- ``pipeline num_proc=2``: the same with two ``datasets.map`` worker processes instead of threads.

tokens/s uses each variant's own token count (the pipeline writes one extra eot per play, closing
each play's val part). ``cpu s`` is user + system time of all threads and map worker processes:
it shows the work done, which contention from other processes barely changes, while the wall
time (and so the ratio) needs idle cores to show the parallel speed-up. Peak memory: the
high-water RSS of a fresh subprocess during a second run of the variant (Linux only).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.peak_memory import high_water_mib, reset_high_water_mark
from minigpt.data import prepare_dataset
from minigpt.data.shakespeare import read_plays
from minigpt.tokenizer import get_tokenizer

CONFIG = {"name": "shakespeare", "source": "shakespeare", "tokenizer": "gpt2", "val_fraction": 0.1,
          "val_split": "tail"}
VARIANTS = ("loop", "loop+read", "pipeline", "pipeline num_proc=2")


def run_loop(docs: list[str], out_dir: Path) -> int:
    enc = get_tokenizer("gpt2")._enc  # the raw tiktoken Encoding
    ids: list[int] = []
    for doc in docs:
        ids.extend(enc.encode_ordinary(doc))
        ids.append(enc.eot_token)
    np.array(ids, dtype=np.uint16).tofile(out_dir / "all.bin")
    return len(ids)


def run_pipeline(out_dir: Path, num_proc: int) -> int:
    meta = prepare_dataset({**CONFIG, "num_proc": num_proc}, out_dir, progress=False)
    assert (out_dir / "shakespeare" / "meta.json").is_file()  # freshly written, not reused
    return meta["train_tokens"] + meta["val_tokens"]


def _cpu_seconds() -> float:
    """User + system CPU of this process (all threads) and its finished children (map workers)."""
    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF,
               resource.RUSAGE_CHILDREN) for f in ("ru_utime", "ru_stime"))


def run(variant: str, docs: list[str]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, tokens written) of one run in a fresh directory."""
    out_dir = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    try:
        cpu, start = _cpu_seconds(), time.perf_counter()
        if variant == "loop":
            tokens = run_loop(docs, out_dir)
        elif variant == "loop+read":
            tokens = run_loop([text for _, text in read_plays()], out_dir)
        else:
            tokens = run_pipeline(out_dir, num_proc=2 if "num_proc=2" in variant else 1)
        return time.perf_counter() - start, _cpu_seconds() - cpu, tokens
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def measure_memory(variant: str) -> float:
    """Peak RSS (MiB) of a fresh process during its second run of the variant (the first one
    imports and loads everything). With num_proc=2 the map workers' memory is not included."""
    out = subprocess.run([sys.executable, "-m", "bench.prepare", "--measure-memory", variant],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_mib"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--measure-memory", metavar="VARIANT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    docs = [text for _, text in read_plays()]
    get_tokenizer("gpt2")  # load the BPE once, outside every timing

    if args.measure_memory:
        run(args.measure_memory, docs)  # once to import and warm up everything
        reset_high_water_mark()
        run(args.measure_memory, docs)
        print(json.dumps({"peak_mib": high_water_mib()}))
        return

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpus: dict[str, list[float]] = {v: [] for v in VARIANTS}
    tokens: dict[str, int] = {}
    load_before = os.getloadavg()[0]
    for round_ in range(args.repeats + 1):  # round 0 is the warm-up
        for variant in VARIANTS:
            seconds, cpu, tokens[variant] = run(variant, docs)
            if round_:
                times[variant].append(seconds)
                cpus[variant].append(cpu)

    print(f"shakespeare, GPT-2 BPE: {len(docs)} plays, {sum(map(len, docs)):,} characters; "
          f"{os.cpu_count()} CPUs, load average {load_before:.1f} -> {os.getloadavg()[0]:.1f} "
          f"(other processes); median of {args.repeats} runs after 1 warm-up")
    print(f"{'variant':<22}{'tokens':>12}{'median s':>10}{'min s':>8}{'cpu s':>8}{'Mtok/s':>9}"
          f"{'vs loop':>9}{'vs loop+read':>14}{'peak MiB':>10}")
    rate = {v: tokens[v] / statistics.median(times[v]) for v in VARIANTS}
    for variant in VARIANTS:
        peak = "-" if args.no_memory else f"{measure_memory(variant):.0f}"
        print(f"{variant:<22}{tokens[variant]:>12,}{statistics.median(times[variant]):>10.3f}"
              f"{min(times[variant]):>8.3f}{statistics.median(cpus[variant]):>8.3f}"
              f"{rate[variant] / 1e6:>9.2f}{rate[variant] / rate['loop']:>8.2f}x"
              f"{rate[variant] / rate['loop+read']:>13.2f}x{peak:>10}")


if __name__ == "__main__":
    main()
