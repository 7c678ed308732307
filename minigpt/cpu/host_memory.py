"""Keep freed large blocks in glibc's heap for reuse: fewer page faults in CPU training.

A training step allocates and frees the same large tensors every step (activations, logit
chunks, gradients). glibc's malloc hands out blocks above its mmap threshold (a few MiB up to
32 MiB, adjusted as the program runs) as fresh ``mmap`` regions and unmaps them when freed, so
each step writes to brand-new pages and pays a page fault per 4 KiB page for them: a visible
share of a CPU step when the vocabulary is GPT-2's (large logit chunks), nothing with a
character vocabulary (``bench/README.md`` has the numbers). Raising the mmap and trim thresholds
keeps freed blocks in the heap, where later steps reuse them (after a few steps the heap holds
the step's peak and no new pages are touched). The price: the process keeps its peak heap until
it exits, which a training run reaches on every step anyway.

``mallopt`` is glibc's own switch; there is no PyTorch setting for this (its CPU allocator is
plain malloc), and the ``MALLOC_*_`` environment variables only work when set before Python
starts.
"""

from __future__ import annotations

import ctypes
import sys

# mallopt parameter numbers from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def keep_freed_memory(mmap_threshold: int = 1 << 30) -> bool:
    """Ask glibc to serve blocks below ``mmap_threshold`` bytes from its heap and never trim the
    heap. Returns whether it took effect (False off Linux or without glibc: nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and \
        bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
