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


def test_progress_bar_refreshes_per_logging_interval_on_gpus():
    from types import SimpleNamespace

    from minigpt.train.callbacks import StepProgressBar

    def trainer(device):
        return SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)),
                               log_every_n_steps=10, accumulate_grad_batches=4, is_global_zero=True)

    bar = StepProgressBar()
    bar.setup(trainer("cpu"), None, "fit")
    assert bar.refresh_rate == 1  # every micro-batch: on a CPU reading the loss costs nothing
    bar.setup(trainer("cuda"), None, "fit")
    assert bar.refresh_rate == 40  # every 10 optimizer steps of 4 micro-batches
