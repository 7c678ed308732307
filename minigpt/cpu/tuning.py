"""Which float32 kernel each linear-layer shape uses on this CPU: measured once, then remembered.

oneDNN's and PyTorch's default (MKL) float32 GEMMs win on different CPUs, shapes and matmuls
(``bench/gemm.py``, ``bench/generate.py``), so no fixed rule holds on every machine. The
speedups therefore time the candidate kernels on the model's own shapes the first time they
meet a (CPU model, torch version, thread count), keep a kernel other than the default only when
it is at least ``MARGIN`` faster, and store the timings in a small JSON file that later runs read
instead of measuring again:

    $MINIGPT_CACHE_DIR/cpu_kernels.json   (default: $XDG_CACHE_HOME/minigpt, ~/.cache/minigpt)

A stored timing is trusted, except that a shape is measured again (the fastest time of each
kernel over all its measurements kept: other work only ever adds time) while

* its ratio is a close call (within ``MARGIN`` of 1: the default stays meanwhile), until it has
  been measured ``CLOSE_CALL_RUNS`` times;
* it was measured under load (more runnable threads than cores) and the machine is not now;
* ``KernelChoices(retune=True)`` (``MINIGPT_CPU_RETUNE=1``): everything afresh.

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
# A close call is measured again on this many start-ups before its timings are trusted.
CLOSE_CALL_RUNS = 3
# Load average per core above which a measurement counts as taken under load.
LOADED_PER_CORE = 1.0
FILE_NAME = "cpu_kernels.json"
RETUNE_ENV = "MINIGPT_CPU_RETUNE"

Timings = dict[str, dict[str, float]]  # shape key -> kernel -> seconds
Measure = Callable[[list[str]], Timings]  # the keys to measure -> their timings


@dataclass(frozen=True)
class Choice:
    """The kernel a shape uses, how much faster than the default it is (1.0: the default),
    whether the timing was read from the file (``cached``) or measured by this process, and
    the measured ratio of the fastest candidate (default time / its time), applied or not."""

    kernel: str
    speedup: float
    cached: bool
    ratio: float = 1.0


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


def load_per_core() -> float:
    """The 1-minute load average per core (0.0 where the OS does not report one)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (AttributeError, OSError):
        return 0.0


class KernelChoices:
    """The timings file of this machine, and the kernel each shape key uses. ``retune``: measure
    every key afresh (default: ``MINIGPT_CPU_RETUNE=1`` in the environment)."""

    def __init__(self, path: str | os.PathLike | None = None, *, retune: bool | None = None):
        self.path = Path(path) if path is not None else default_cache_dir() / FILE_NAME
        self.retune = os.environ.get(RETUNE_ENV, "") not in ("", "0") if retune is None \
            else retune

    def timings(self, keys: Iterable[str], measure: Measure,
                default: str | None = None) -> tuple[Timings, set[str]]:
        """The timings of ``keys``: from the file where trusted (see the module docstring;
        ``default``: the kernel a close call keeps), else from ``measure(those keys)``, merged
        and saved; also the keys that came from the file unmeasured."""
        keys = list(dict.fromkeys(keys))
        everything = self._read()
        known = everything.get(machine_key(), {})
        load = load_per_core()
        stale = [k for k in keys if self._stale(known.get(k), default, load)]
        if stale:
            fresh = measure(stale)
            for k in stale:
                known[k] = _merged(None if self.retune else _entry(known.get(k)), fresh[k], load)
            everything[machine_key()] = known
            self._write(everything)
        return {k: dict(_entry(known[k])["seconds"]) for k in keys}, set(keys) - set(stale)

    def _stale(self, raw, default: str | None, load: float) -> bool:
        entry = _entry(raw)
        if entry is None or self.retune:
            return True
        then = entry["load"]
        if then is None or (then > LOADED_PER_CORE >= load):
            return True  # taken under load (or when unknown): a quiet moment reads truer
        close = default is not None and 1 / MARGIN < pick(entry["seconds"], default).ratio \
            < MARGIN
        return close and entry["runs"] < CLOSE_CALL_RUNS

    def _read(self) -> dict[str, dict]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write(self, everything: dict[str, dict]) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            text = json.dumps(everything, indent=1, sort_keys=True)
            atomic_write(self.path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
        except OSError:  # a read-only home: measure again next time rather than fail the run
            pass


def _entry(raw) -> dict | None:
    """A stored key's ``{"seconds": {kernel: s}, "load": per core or None, "runs": n}``; a
    bare ``{kernel: s}`` (files written before loads were kept) has an unknown load; None if
    malformed."""
    if _valid(raw):
        return {"seconds": raw, "load": None, "runs": 1}
    if not isinstance(raw, dict) or not _valid(raw.get("seconds")):
        return None
    load, runs = raw.get("load"), raw.get("runs")
    if not isinstance(load, (int, float)) or not isinstance(runs, int) or runs < 1:
        return None
    return {"seconds": raw["seconds"], "load": float(load), "runs": runs}


def _merged(old: dict | None, seconds: dict[str, float], load: float) -> dict:
    """A key's entry after a new measurement: each kernel's fastest time over all of them (load
    only ever adds time), the quietest load they were taken at, one more run."""
    if old is None:
        return {"seconds": dict(seconds), "load": round(load, 3), "runs": 1}
    merged = {k: min(t, old["seconds"].get(k, t)) for k, t in seconds.items()}
    then = old["load"] if old["load"] is not None else load
    return {"seconds": merged, "load": round(min(then, load), 3), "runs": old["runs"] + 1}


def pick(timings: dict[str, float], default: str, cached: bool = False) -> Choice:
    """The fastest kernel of one key's ``timings``, if ``MARGIN`` faster than ``default``."""
    if default not in timings:
        return Choice(default, 1.0, cached)
    others = [k for k in timings if k != default]
    if not others:
        return Choice(default, 1.0, cached)
    best = min(others, key=timings.get)
    ratio = timings[default] / timings[best] if timings[best] > 0 else 1.0
    if ratio < MARGIN:
        return Choice(default, 1.0, cached, ratio)
    return Choice(best, ratio, cached, ratio)


def _valid(timings) -> bool:
    return isinstance(timings, dict) and bool(timings) and all(
        isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0
        for t in timings.values())


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


def shape_of(key: str) -> str:
    """The shape in a timings key ('decode float32 768x2304' -> '768x2304')."""
    words = key.split()
    return words[2] if len(words) > 2 else key


def describe(choices: dict[str, Choice], label: Callable[[str], str] = str) -> str:
    """Why, per key: its ``label`` and measured ratio (the fastest candidate against the
    default, applied or not), then whether the timings were cached or measured now, e.g.
    '768x2304 x1.34, 768x768 x0.98; cached'."""
    if not choices:
        return "nothing measured"
    ratios = ", ".join(f"{label(key)} x{c.ratio:.2f}" for key, c in choices.items())
    cached = sum(c.cached for c in choices.values())
    source = "cached" if cached == len(choices) else "measured" if not cached else \
        f"{len(choices) - cached} of {len(choices)} measured"
    return f"{ratios}; {source}"
