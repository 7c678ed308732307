"""The pieces of ``data.batch_size=auto`` that know nothing about models: the memory budget
(``trainer.memory_budget``), the memory this process may use, and the search for the largest
micro-batch that fits.

``largest_that_fits`` takes a ``fits(n)`` answer that is true up to some size and false above
it, and finds that size with few questions (doubling, then bisecting): on the CPU the question
is the preflight's estimate against the memory, on CUDA a real training step at that size
(``minigpt.train.auto_batch``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch

from minigpt.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)
BUDGET_WORDS = "bytes (an integer) or a size such as 8GB, 12GiB, 512MB"


def parse_memory_budget(value) -> int | None:
    """``trainer.memory_budget`` in bytes: ``None`` (no budget), a positive integer of bytes, or
    a string such as ``"8GB"`` (10**9), ``"12GiB"`` (2**30), ``"1.5 TB"``. A ``ConfigError``
    naming the value otherwise."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = value, ""
    else:
        match = _SIZE.fullmatch(value) if isinstance(value, str) else None
        if match is None or match.group(2).lower() not in _UNITS:
            raise ConfigError(f"trainer.memory_budget={value!r} must be {BUDGET_WORDS}")
        number, unit = float(match.group(1)), match.group(2).lower()
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise ConfigError(f"trainer.memory_budget={value!r} must be {BUDGET_WORDS}, above 0")
    return size


def is_memory_budget(value) -> bool:
    """Whether ``parse_memory_budget`` takes ``value`` (the config rule)."""
    try:
        parse_memory_budget(value)
    except ConfigError:
        return False
    return True


def cgroup_memory_left(root: str | Path = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's control group may still allocate (its limit minus its usage), or
    ``None`` without a limit. A container's limit kills the process before ``MemAvailable``
    says the machine is full."""
    root = Path(root)
    for limit_file, usage_file in (("memory.max", "memory.current"),  # cgroup v2
                                   ("memory/memory.limit_in_bytes",  # cgroup v1
                                    "memory/memory.usage_in_bytes")):
        try:
            limit = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:  # v1: "no limit"
            return None
        return max(0, int(limit) - usage)
    return None


def within_budget(available: int, where: str, budget: int | None) -> tuple[int, str]:
    """The smaller of what ``where`` has and ``trainer.memory_budget``, and its name."""
    if budget is not None and budget < available:
        return budget, f"trainer.memory_budget on {where}"
    return available, where


def largest_that_fits(fits: Callable[[int], bool], upper: int) -> int:
    """The largest ``n`` in ``[1, upper]`` with ``fits(n)``, for a ``fits`` that holds up to some
    size and fails above it; 0 when even 1 does not fit. Asks ``fits`` about 1, 2, 4, ... until
    one fails, then bisects between the last that fit and the first that did not: about
    2 log2(n) questions, each size at most once."""
    if upper < 1 or not fits(1):
        return 0
    good, bad = 1, None  # the largest size known to fit, the smallest known not to
    while bad is None and good < upper:
        candidate = min(2 * good, upper)
        if fits(candidate):
            good = candidate
        else:
            bad = candidate
    if bad is None:
        return good
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


def fits_when_tried(try_size: Callable[[int], bool | None],
                    release: Callable[[], None] = lambda: None,
                    agree: Callable[[bool], bool] = lambda fit: fit) -> Callable[[int], bool]:
    """A ``fits(n)`` for ``largest_that_fits`` that runs ``try_size(n)``: it fits unless that
    raises ``torch.OutOfMemoryError`` or returns False. ``release()`` runs after every try, once
    the error (whose traceback holds the try's tensors) is gone, so each try starts from the
    same memory; ``agree(fit)`` makes every process give the same answer."""

    def fits(n: int) -> bool:
        try:
            fit = try_size(n) is not False
        except torch.OutOfMemoryError:
            fit = False
        release()
        return agree(fit)

    return fits


def largest_divisor_at_most(rows: int, limit: int) -> int:
    """The largest divisor of ``rows`` that is at most ``limit`` (at least 1): a micro-batch
    that accumulates to exactly ``rows`` rows per process."""
    return max(d for d in range(1, max(1, min(rows, limit)) + 1) if rows % d == 0)
