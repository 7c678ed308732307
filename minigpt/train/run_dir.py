"""One run per directory: a new run never writes where another run's checkpoints are, and a run
that fails before it trains leaves nothing behind.

``configs/train.yaml`` names the run directory ``${run_dir:outputs/<date>}``: the resolver claims
``<HH-MM-SS>`` under it with an atomic ``mkdir`` (``-2``, ``-3``, ... when runs start in the same
second), or returns the id that every rank of a torchrun / SLURM launch shares.
"""

from __future__ import annotations

import os
import shutil
from datetime import datetime
from pathlib import Path

from minigpt.errors import ConfigError

# What a run (and Hydra, for it) writes into its directory before training: removed again when
# the run fails before its first step. Nothing else is ever removed.
STARTUP_FILES = (".hydra", "train.log", "config.yaml", "csv", "wandb", "samples.txt")


def run_id() -> str:
    """The time (HH-MM-SS), or for a multi-process launch by torchrun or srun an id that every
    rank and node shares (their clocks may straddle a second)."""
    env = os.environ
    if env.get("TORCHELASTIC_RUN_ID", "none") != "none":
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}"
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in env:
        return f"slurm-{env['SLURM_JOB_ID']}-{env.get('SLURM_STEP_ID', '0')}"
    return datetime.now().strftime("%H-%M-%S")


def claim_run_dir(parent: str) -> str:
    """``parent/<run_id>``, created here when it is a time, so that two runs started in the same
    second get two directories (the second gets ``-2``); a launch's shared id is not claimed."""
    name = run_id()
    if not name[:2].isdigit():
        return str(Path(parent) / name)
    Path(parent).mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        candidate = Path(parent) / (name if n == 1 else f"{name}-{n}")
        try:
            candidate.mkdir()
            return str(candidate)
        except FileExistsError:
            continue
    raise ConfigError(f"{parent} already holds 999 runs named {name}; set hydra.run.dir")


def check_run_dir_free(run_dir: Path, ckpt_path: str | None) -> None:
    """Refuse to start a new run in a directory where another run started (its config.yaml)
    or left checkpoints, unless it resumes from a checkpoint."""
    checkpoints = run_dir / "checkpoints"
    held = sorted(p.name for p in checkpoints.iterdir()) if checkpoints.is_dir() else []
    if ckpt_path or not (held or (run_dir / "config.yaml").exists()):
        return
    what = f"another run's checkpoints ({', '.join(held)})" if held else "another run"
    raise ConfigError(
        f"hydra.run.dir={run_dir} holds {what}; to continue that run add "
        f"ckpt_path={checkpoints / 'last.ckpt'}, to start a new one leave hydra.run.dir unset or "
        "name a new directory")


def remove_unstarted(run_dir: Path) -> None:
    """After a failure before the first training step: remove what this run wrote, and the
    directory itself if that leaves it empty. Files it does not know are left alone."""
    if (run_dir / "checkpoints").exists():
        return
    for name in STARTUP_FILES:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists() or path.is_symlink():
            path.unlink(missing_ok=True)
    for directory in (run_dir, run_dir.parent):  # and outputs/<date> when this run made it alone
        try:
            directory.rmdir()
        except OSError:  # not empty: other runs or someone else's files
            return
