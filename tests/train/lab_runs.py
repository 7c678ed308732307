"""What the lab tests share: a shrunk toy run and running a script of the repo in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHRUNK = [
    "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.context_length=64",
    "data.batch_size=4", "data.val_tokens=256", "trainer=cpu", "trainer.max_steps=4",
    "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false", "trainer.precision=32-true", "sample.max_new_tokens=4",
    "threads=1",
]


def _python(tmp_path, *args, timeout=300):
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, *map(str, args)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout
