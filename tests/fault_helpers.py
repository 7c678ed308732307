"""A process that holds a run directory's writer lock, as a training process does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
