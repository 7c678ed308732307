"""One writer per run directory: the lock a training process holds, refused to a second process
with one line naming the holder, released on exit and never stale after a crash."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_helpers import ROOT, hold_in_another_process

from minigpt.errors import ConfigError
from minigpt.train.run_dir import LOCK_FILE, RunDirLock, remove_unstarted


def test_a_second_writer_is_refused_with_the_holders_pid(tmp_path):
    first = RunDirLock(tmp_path).acquire()
    with pytest.raises(ConfigError) as error:
        RunDirLock(tmp_path).acquire()
    message = str(error.value)
    assert "\n" not in message
    assert f"{tmp_path} is in use by another training process (pid {os.getpid()} on " in message
    assert "set hydra.run.dir to another directory" in message
    first.release()
    assert not (tmp_path / LOCK_FILE).exists()  # released: its file is gone
    RunDirLock(tmp_path).acquire().release()


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    holder = hold_in_another_process(tmp_path)
    with pytest.raises(ConfigError, match=f"pid {holder.pid} "):
        RunDirLock(tmp_path).acquire()
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert (tmp_path / LOCK_FILE).exists()  # its file stays, but the kernel dropped the lock
    lock = RunDirLock(tmp_path).acquire()
    assert (tmp_path / LOCK_FILE).read_text().split()[0] == str(os.getpid())
    lock.release()


def test_a_failed_start_removes_the_lock_file_it_holds(tmp_path):
    run_dir = tmp_path / "run"
    lock = RunDirLock(run_dir).acquire()
    (run_dir / "config.yaml").write_text("x")
    remove_unstarted(run_dir)  # while the lock is held, as run() does
    assert not run_dir.exists()
    lock.release()
    assert not run_dir.exists()


def test_only_rank_zero_of_a_launch_takes_it(tmp_path, monkeypatch):
    from lightning.fabric.utilities import rank_zero_only

    holder = RunDirLock(tmp_path).acquire()
    monkeypatch.setattr(rank_zero_only, "rank", 1)  # another rank of the same launch
    RunDirLock(tmp_path).acquire().release()  # neither refused nor removing rank 0's lock
    assert (tmp_path / LOCK_FILE).read_text().split()[0] == str(os.getpid())
    holder.release()


# ---- through the real command: the lock comes before Hydra writes anything -----------------

def train_py(cwd: Path, *args: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def hydra_files(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run_dir / ".hydra").iterdir())}


def test_a_second_train_py_is_refused_before_hydra_writes_there(tmp_path):
    """A first ``python train.py`` held in data preparation holds the lock; a second one into
    the same directory is refused with one line naming it, and the first run's ``.hydra/``
    files (its config) and lock are byte for byte what they were."""
    run_dir = tmp_path / "run"
    first = train_py(tmp_path, f"hydra.run.dir={run_dir}", "data.name=stalled",
                     "data.source=tests.fault_helpers.stalled_documents", "data.tokenizer=char",
                     f"data_root={tmp_path / 'data'}", "logger=none", "model.n_layer=1")
    try:
        deadline = time.monotonic() + 120
        while not ((run_dir / ".hydra" / "overrides.yaml").exists()
                   and (run_dir / LOCK_FILE).exists()):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.5)
        before, lock = hydra_files(run_dir), (run_dir / LOCK_FILE).read_bytes()
        second = train_py(tmp_path, f"hydra.run.dir={run_dir}", "logger=none", "model.n_layer=3")
        _, err = second.communicate(timeout=120)
        after = hydra_files(run_dir)
        assert first.poll() is None  # still holding it
    finally:
        first.kill()
        first.communicate()
    assert second.returncode == 2, err[-2000:]
    assert err.strip() == (f"error: {run_dir} is in use by another training process (pid "
                           f"{first.pid} on {socket.gethostname()}); only one process writes "
                           "into a run directory: wait for it to finish or stop it, or set "
                           "hydra.run.dir to another directory")
    assert b"n_layer: 1" in after["config.yaml"] and after == before
    assert lock.split()[0] == str(first.pid).encode()


def test_a_finished_runs_directory_is_refused_before_hydra_writes_there(tmp_path):
    """A new run (no ``ckpt_path``) aimed at a finished run's directory: refused, and that
    run's ``.hydra/`` config is left as it was."""
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("the first run's config\n")
    (run_dir / "config.yaml").write_text("the first run's resolved config\n")
    second = train_py(tmp_path, f"hydra.run.dir={run_dir}", "logger=none")
    _, err = second.communicate(timeout=120)
    assert second.returncode == 2, err[-2000:]
    assert err.strip().startswith(f"error: hydra.run.dir={run_dir} holds another run; "), err
    assert hydra_files(run_dir) == {"config.yaml": b"the first run's config\n"}
    assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", "config.yaml"]
