"""Peak resident memory of a piece of work, measured in a fresh process.

Torch's CPU tensors come from malloc, which tracemalloc does not see, and freed memory may stay
resident in malloc's heap, hiding later peaks. So ``in_subprocess`` starts the measuring process
with ``MALLOC_MMAP_THRESHOLD_`` fixed at 64 KiB: every tensor above that is its own mmap, returned
to the OS when freed, and the resident set follows the live tensors. ``peak_extra_mib`` takes the
resident set as the baseline, resets the kernel's high-water mark (writing 5 to
/proc/self/clear_refs, Linux >= 4.0), runs the work and reads the high-water mark ``VmHWM``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_high_water_mark() -> None:
    """Restart the kernel's resident-set high-water mark (``VmHWM``) from the current level."""
    Path("/proc/self/clear_refs").write_text("5")


def high_water_mib() -> float:
    """The resident set's highest level (MiB) since the process started or the last reset."""
    return rss_kib("VmHWM") / 1024


def peak_extra_mib(work: Callable[[], object]) -> float:
    """MiB the resident set rose above its level before ``work()`` at its highest."""
    baseline = rss_kib("VmRSS") / 1024
    reset_high_water_mark()
    work()
    return high_water_mib() - baseline


def in_subprocess(module: str, args: list[str]) -> dict:
    """Run ``python -m module args`` with the fixed mmap threshold; its last stdout line is
    JSON. The child finds ``bench`` as this process did (same working directory and path)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
    out = subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(args)} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
