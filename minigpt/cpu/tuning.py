"""Which float32 kernel each linear-layer shape uses on this CPU: measured once, then remembered.

oneDNN's and PyTorch's default (MKL) float32 GEMMs win on different CPUs, shapes and matmuls
(``bench/gemm.py``, ``bench/generate.py``), so no fixed rule holds on every machine. The
speedups therefore time the candidate kernels on the model's own shapes the first time they
meet a (CPU model, torch version, thread count), keep a kernel other than the default only when
it is at least ``MARGIN`` faster, and store the timings in a small JSON file that later runs read
instead of measuring again:

    $MINIGPT_CACHE_DIR/cpu_kernels.json   (default: $XDG_CACHE_HOME/minigpt, ~/.cache/minigpt)

``KernelChoices(path)`` points it elsewhere (tests use a temporary directory); an unreadable or
malformed file counts as empty and is rewritten.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from minigpt.files import atomic_write

# A candidate replaces the default kernel only when at least this much faster: timing noise
# must not flip a shape to a kernel that is not really faster.
MARGIN = 1.05
FILE_NAME = "cpu_kernels.json"

Timings = dict[str, dict[str, float]]  # shape key -> kernel -> seconds
Measure = Callable[[list[str]], Timings]  # the keys to measure -> their timings


@dataclass(frozen=True)
class Choice:
    """The kernel a shape uses, how much faster than the default it measured, and whether the
    timing was read from the file (``cached``) or measured by this process."""

    kernel: str
    speedup: float
    cached: bool


def default_cache_dir() -> Path:
    if os.environ.get("MINIGPT_CACHE_DIR"):
        return Path(os.environ["MINIGPT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "minigpt"


def machine_key() -> str:
    """What a timing depends on besides the shape: the CPU model, torch version and threads."""
    return f"{cpu_model()} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


class KernelChoices:
    """The timings file of this machine, and the kernel each shape key uses."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else default_cache_dir() / FILE_NAME

    def timings(self, keys: Iterable[str], measure: Measure) -> tuple[Timings, set[str]]:
        """The timings of ``keys``: from the file, or from ``measure(missing keys)`` (then
        saved); also the keys that came from the file."""
        keys = list(dict.fromkeys(keys))
        everything = self._read()
        known = everything.get(machine_key(), {})
        missing = [k for k in keys if not _valid(known.get(k))]
        if missing:
            known.update(measure(missing))
            everything[machine_key()] = known
            self._write(everything)
        return {k: known[k] for k in keys}, set(keys) - set(missing)

    def _read(self) -> dict[str, Timings]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write(self, everything: dict[str, Timings]) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            text = json.dumps(everything, indent=1, sort_keys=True)
            atomic_write(self.path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
        except OSError:  # a read-only home: measure again next time rather than fail the run
            pass


def pick(timings: dict[str, float], default: str, cached: bool = False) -> Choice:
    """The fastest kernel of one key's ``timings``, if ``MARGIN`` faster than ``default``."""
    if default not in timings:
        return Choice(default, 1.0, cached)
    best = min(timings, key=timings.get)
    speedup = timings[default] / timings[best] if timings[best] > 0 else 1.0
    if speedup < MARGIN:
        return Choice(default, 1.0, cached)
    return Choice(best, speedup, cached)


def _valid(timings) -> bool:
    return isinstance(timings, dict) and bool(timings) and all(
        isinstance(t, (int, float)) and t >= 0 for t in timings.values())


def clock() -> Callable[[], float]:
    """The clock kernels are timed with: on one thread its CPU time, which other processes on
    a shared machine cannot inflate by taking the core away; else wall time."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def fastest_seconds(kernels: dict[str, Callable[[], object]], repeats: int = 3) -> dict[str, float]:
    """Seconds per call of each kernel: one warm-up call each, then the fastest of ``repeats``
    calls taken in turn (other work on the machine only ever adds time to a call)."""
    for kernel in kernels.values():
        kernel()
    now = clock()
    best = dict.fromkeys(kernels, float("inf"))
    for _ in range(repeats):
        for name, kernel in kernels.items():
            start = now()
            kernel()
            best[name] = min(best[name], now() - start)
    return best


def describe(choices: dict[str, Choice], default: str) -> str:
    """Why, in a few words: 'measured x1.31' / 'cached x1.2-1.4' for the keys that left the
    default, 'not faster here' when none did."""
    faster = [c for c in choices.values() if c.kernel != default]
    if not faster:
        return "not faster here"
    source = "cached" if all(c.cached for c in faster) else "measured"
    low, high = min(c.speedup for c in faster), max(c.speedup for c in faster)
    span = f"x{low:.2f}" if f"{low:.2f}" == f"{high:.2f}" else f"x{low:.2f}-{high:.2f}"
    return f"{source} {span}"
