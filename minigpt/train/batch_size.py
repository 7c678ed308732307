"""The pieces of ``data.batch_size=auto`` that know nothing about models: the memory budget
(``trainer.memory_budget``), the memory this process may use, and the search for the largest
micro-batch that fits.

``largest_that_fits`` takes a ``fits(n)`` answer that is true up to some size and false above
it, and finds that size with few questions (doubling, then bisecting): on the CPU the question
is the preflight's estimate against the memory, on CUDA a real training step at that size
(``minigpt.train.auto_batch``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch


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
