"""One writer per run directory: the lock a training process holds, refused to a second process
with one line naming the holder, released on exit and never stale after a crash."""

from __future__ import annotations

import os
import signal

import pytest
from fault_helpers import hold_in_another_process

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
