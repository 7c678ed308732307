"""Faults for tests to inject: a process holding a run directory's writer lock (as a training
process does), and a small filesystem to fill."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOLD = ("import sys, time; from pathlib import Path; from minigpt.train.run_dir import RunDirLock; "
        "lock = RunDirLock(Path(sys.argv[1])).acquire(); print('held', flush=True); "
        "time.sleep(600)")


def hold_in_another_process(run_dir: Path) -> subprocess.Popen:
    """A process that holds ``run_dir``'s lock until it is killed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], env=env,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@contextlib.contextmanager
def small_tmpfs(mount: Path, size: str = "1m"):
    """A tmpfs of ``size`` at ``mount`` (created), unmounted afterwards; the test is skipped
    where it cannot be mounted (not root, or no mount rights in this container)."""
    mount.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
            capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root and mount rights)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def stalled_documents(seconds: float = 600):
    """A data source (``data.source=tests.fault_helpers.stalled_documents``) that waits before
    its one document: a training process held in data preparation, its run directory locked."""
    time.sleep(seconds)
    yield "a document\n"
