"""A full disk never costs a checkpoint: a write that fails during a real run keeps the previous
``best``/``last`` loadable, leaves no partial file, stops the run with one line, and nothing is
staged in the system temp directory."""

from __future__ import annotations

import errno
import tempfile
from pathlib import Path

import pytest
import torch
from fault_helpers import small_tmpfs
from test_run import data_root, tiny_cfg  # noqa: F401 (data_root: a fixture, used by name)

from minigpt.checkpoint import load_checkpoint
from minigpt.checkpoint.write import CheckpointWriteError
from minigpt.train.run import run


def no_space_on_second_save(monkeypatch) -> list[Path]:
    """``torch.save`` writes the first checkpoint; the second gets 1000 bytes out, then the
    file layer's ``ENOSPC``. Returns the paths it was asked to write."""
    real_save, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        calls.append(Path(f))
        if len(calls) == 1:
            return real_save(obj, f, *args, **kwargs)
        Path(f).write_bytes(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", save)
    return calls


def assert_previous_checkpoint_kept(run_dir: Path, step: int) -> None:
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["best.ckpt", "last.ckpt"]
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == step
    model, _, _ = load_checkpoint(checkpoints / "best.ckpt")
    assert model.config.n_layer == 2


def test_a_failed_checkpoint_write_keeps_the_previous_one(tmp_path, data_root, monkeypatch):  # noqa: F811
    system_temp = tmp_path / "system-temp"
    system_temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_temp))
    calls = no_space_on_second_save(monkeypatch)
    run_dir = tmp_path / "run"
    with pytest.raises(CheckpointWriteError) as failed:
        run(tiny_cfg(data_root), run_dir)  # checkpoints at steps 4 and 8
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith(f"{run_dir / 'checkpoints'}/"), message
    assert "no space left on the device (1,000 bytes written before it filled" in message
    assert "free disk space there or write to another directory" in message
    assert "(the previous checkpoint) unchanged" in message
    assert_previous_checkpoint_kept(run_dir, 4)
    # Fabric was handed the temporary name beside the target, and wrote nothing elsewhere.
    assert [p.parent for p in calls] == [run_dir / "checkpoints"] * 2
    assert list(system_temp.iterdir()) == []


def test_a_checkpoint_on_a_full_filesystem(tmp_path, data_root):  # noqa: F811
    """A real full disk: a 640 KiB tmpfs holds the first checkpoint (about 420 KB), not the
    second beside it."""
    with small_tmpfs(tmp_path / "small", size="640k") as disk:
        with pytest.raises(CheckpointWriteError, match="no space left on the device") as failed:
            run(tiny_cfg(data_root), disk / "run")
        assert "(the previous checkpoint) unchanged" in str(failed.value)
        assert_previous_checkpoint_kept(disk / "run", 4)


def test_the_first_checkpoint_not_fitting_says_so(tmp_path, data_root):  # noqa: F811
    with small_tmpfs(tmp_path / "small", size="200k") as disk:
        with pytest.raises(CheckpointWriteError) as failed:
            run(tiny_cfg(data_root), disk / "run")
        assert "this was the run's first checkpoint, so none is on disk" in str(failed.value)
        assert list((disk / "run" / "checkpoints").iterdir()) == []


def test_a_full_disk_on_rank_0_stops_both_ranks_with_one_line(tmp_path, data_root):  # noqa: F811
    """Two DDP processes (gloo): the second checkpoint fails on rank 0, the one that writes it.
    Both processes end (no rank left waiting at a barrier) with the same one line; the first
    checkpoint is kept and no partial file is left."""
    from test_run import TINY, _train_py

    run_dir = tmp_path / "run"
    result = _train_py(
        tmp_path, *TINY, f"data_root={data_root}", "trainer=ddp", "trainer.accelerator=cpu",
        "trainer.devices=2", "trainer.max_steps=8", "trainer.val_check_interval=4",
        f"hydra.run.dir={run_dir}", timeout=240,
        script=Path(__file__).with_name("full_disk_train.py"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(lines) == 2 and lines[0] == lines[1], result.stderr[-3000:]  # rank 0, rank 1
    assert lines[0].startswith(f"error: {run_dir / 'checkpoints'}/"), lines
    assert "no space left on the device (1,000 bytes written before it filled" in lines[0]
    assert "(the previous checkpoint) unchanged" in lines[0]
    assert_previous_checkpoint_kept(run_dir, 4)


def test_torchs_zip_writer_cut_short_is_named_a_full_disk(tmp_path, data_root, monkeypatch):  # noqa: F811
    """torch's zip writer reports a write the disk refused as its own ``RuntimeError`` (no
    errno): the line says the disk is full, how much is free, and what to do, not torch's
    words."""
    real_save, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) == 1:
            return real_save(obj, f, *args, **kwargs)
        Path(f).write_bytes(b"\0" * 1000)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1088 vs "
                           "960")

    monkeypatch.setattr(torch, "save", save)
    run_dir = tmp_path / "run"
    with pytest.raises(CheckpointWriteError) as failed:
        run(tiny_cfg(data_root), run_dir)
    message = str(failed.value)
    assert "\n" not in message and "inline_container" not in message, message
    assert "no space left on the device (1,000 bytes written before it filled" in message
    assert f"bytes are free in {run_dir / 'checkpoints'}" in message
    assert "free disk space there or write to another directory" in message
    assert failed.value.errno == errno.ENOSPC
    assert_previous_checkpoint_kept(run_dir, 4)


def test_a_full_disk_with_room_left_once_the_partial_file_is_gone(tmp_path, data_root):  # noqa: F811
    """A checkpoint of about 5 MB on an 8 MiB tmpfs: the second stops when the disk fills, and
    removing its partial file frees megabytes again; the line still says the disk was full."""
    with small_tmpfs(tmp_path / "small", size="8m") as disk:
        with pytest.raises(CheckpointWriteError) as failed:
            run(tiny_cfg(data_root, "model.n_embd=128"), disk / "run")
        message = str(failed.value)
        assert "no space left on the device" in message and "inline_container" not in message
        assert "(the previous checkpoint) unchanged" in message
        assert_previous_checkpoint_kept(disk / "run", 4)
