"""minigpt.train.callbacks: checkpoint files are written whole or not at all."""

import pytest
import torch

from minigpt.train.callbacks import AtomicCheckpointIO


def test_atomic_checkpoint_io_never_leaves_a_partial_file(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1}, path)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"step": 2}, path)
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
