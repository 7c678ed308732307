"""One run per directory: a new run never writes where another run's checkpoints are, one
process at a time writes into a run directory (``LockRunDir``, a Hydra callback, locks it before
Hydra writes there), and a run that fails before it trains leaves nothing behind.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
from datetime import datetime
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from minigpt.errors import ConfigError, first_line, one_line_errors

# The advisory lock a training process holds on its run directory; it holds "<pid> <host>".
LOCK_FILE = ".writer.lock"
# What a run (and Hydra, for it) writes into its directory before training: removed again when
# the run fails before its first step. Nothing else is ever removed.
STARTUP_FILES = (".hydra", "train.log", "config.yaml", "csv", "wandb", "samples.txt", LOCK_FILE)


def run_id() -> str:
    """The time (HH-MM-SS), or for a multi-process launch by torchrun or srun an id that every
    rank and node shares (their clocks may straddle a second)."""
    env = os.environ
    if env.get("TORCHELASTIC_RUN_ID", "none") != "none":
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}"
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in env:
        return f"slurm-{env['SLURM_JOB_ID']}-{env.get('SLURM_STEP_ID', '0')}"
    return datetime.now().strftime("%H-%M-%S")


def launch_rank() -> int:
    """This process's rank in its launch: Lightning's once set, else the launcher's environment
    read as Lightning reads it (train.py locks the run directory before it imports Lightning)."""
    from lightning_utilities.core.rank_zero import rank_zero_only  # Lightning's, without it

    rank = getattr(rank_zero_only, "rank", None)
    if rank is None:
        keys = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")
        rank = next((int(os.environ[key]) for key in keys if key in os.environ), 0)
    return rank


def claim_run_dir(parent: str) -> str:
    """``parent/<run_id>``, created here when it is a time, so that two runs started in the same
    second get two directories (the second gets ``-2``); a launch's shared id is not claimed."""
    name = run_id()
    if not name[:2].isdigit():
        return str(Path(parent) / name)
    Path(parent).mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        candidate = Path(parent) / (name if n == 1 else f"{name}-{n}")
        with contextlib.suppress(FileExistsError):  # another run's: try the next name
            candidate.mkdir()
            return str(candidate)
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


def hold_run_dir(run_dir: Path, ckpt_path: str | None) -> RunDirLock:
    """This process's writer lock on ``run_dir``: the one ``LockRunDir`` took already, else the
    directory checked free and locked now. The caller releases it."""
    held = _HELD.get(run_dir)
    if held is not None and held.file is not None:
        return held
    check_run_dir_free(run_dir, ckpt_path)  # before anything of ours is written there
    _HELD[run_dir] = lock = RunDirLock(run_dir).acquire()
    return lock


class RunDirLock:
    """The one writer of a run directory: an advisory ``flock`` on ``<run_dir>/.writer.lock``
    (the kernel drops it when the process dies: no stale lock). Only a launch's rank 0 takes it,
    so its other ranks do not refuse each other; a second launch is refused naming the holder."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.file = None

    def acquire(self) -> RunDirLock:
        """Take the lock or raise ``ConfigError`` naming the process that holds it."""
        try:
            import fcntl
        except ImportError:  # not POSIX: no cross-process lock
            return self
        if launch_rank() != 0:
            return self
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            while self.file is None:
                f = open(self.path, "a+")
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    f.seek(0)
                    holder = f.read().split()
                    f.close()
                    raise ConfigError(self._refusal(holder)) from None
                if _same_file(f, self.path):  # not a lock file its holder just removed
                    self.file = f
                else:
                    f.close()
            self.file.truncate(0)
            self.file.write(f"{os.getpid()} {socket.gethostname()}\n")
            self.file.flush()
        except OSError as e:
            raise ConfigError(f"hydra.run.dir={self.path.parent} cannot be written "
                              f"({first_line(e)}); point hydra.run.dir at a writable directory") \
                from None
        return self

    def release(self) -> None:
        """Drop the lock and remove its file (unless a failed start removed it already)."""
        if _HELD.get(self.path.parent) is self:
            del _HELD[self.path.parent]
        if self.file is None:
            return
        if _same_file(self.file, self.path):
            self.path.unlink()  # while still held: a process waiting on it sees it go and retries
        self.file.close()
        self.file = None

    def _refusal(self, holder: list[str]) -> str:
        pid = f"pid {holder[0]}" + (f" on {holder[1]}" if len(holder) > 1 else "") \
            if holder else "a process that is starting"
        return (f"{self.path.parent} is in use by another training process ({pid}); only one "
                "process writes into a run directory: wait for it to finish or stop it, or set "
                "hydra.run.dir to another directory")


_HELD: dict[Path, RunDirLock] = {}  # run directory -> the lock this process took on it


def _same_file(f, path: Path) -> bool:
    """Whether the open file ``f`` is still the file at ``path``."""
    try:
        here, there = os.fstat(f.fileno()), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


class LockRunDir(Callback):
    """Takes the run directory's writer lock (``hold_run_dir``) in ``on_run_start``, before Hydra
    writes ``.hydra/`` and ``train.log`` there: a second process aimed at a directory in use, or
    at a finished run's without ``ckpt_path``, is refused in one line and changes nothing."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Hydra's own first step of the job, done early: interpolations such as ${hydra:job.name}
        # in hydra.run.dir need it.
        HydraConfig.instance().set_config(config)
        with one_line_errors():  # Hydra turns an exception raised here into a warning
            run_dir = Path(str(OmegaConf.select(config, "hydra.run.dir"))).resolve()
            lock = hold_run_dir(run_dir, OmegaConf.select(config, "ckpt_path"))
        atexit.register(lock.release)  # the run releases it first when it gets that far
