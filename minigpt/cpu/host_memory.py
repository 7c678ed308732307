"""Keep freed large blocks in glibc's heap for reuse, so that a CPU training step, which frees
and makes the same large tensors every step, stops page-faulting on fresh ``mmap`` regions. The
process keeps its peak heap until it exits. ``mallopt`` is glibc's own switch (PyTorch's CPU
allocator is plain malloc; the ``MALLOC_*_`` variables work only when set before Python starts).
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
