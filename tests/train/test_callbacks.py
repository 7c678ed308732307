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


class _ScriptedValLoss(__import__("lightning").LightningModule):
    """A one-weight model whose validation reports the losses it is given, in turn."""

    def __init__(self, val_losses):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.val_losses = list(val_losses)

    def training_step(self, batch, batch_idx):
        return (self.weight - batch[0]).pow(2).sum()

    def validation_step(self, batch, batch_idx):
        pass

    def on_validation_epoch_end(self):
        self.log("val/loss", self.val_losses.pop(0))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_last_links_to_best_when_they_hold_the_same_state(tmp_path):
    """val/loss 2.0 (best), 3.0 (worse), 1.0 (best again) at steps 1, 2, 3: last is a link to
    best at steps 1 and 3 and its own file at step 2; best keeps its step."""
    import os

    import lightning as L
    from torch.utils.data import DataLoader

    from minigpt.train.callbacks import LinkingModelCheckpoint

    class Inspect(L.Callback):  # Lightning runs checkpoint callbacks last: look a hook later
        seen = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step:
                self.look(trainer)

        def on_train_end(self, trainer, pl_module):
            self.look(trainer)

        def look(self, trainer):
            last, best = tmp_path / "last.ckpt", tmp_path / "best.ckpt"
            self.seen.append((trainer.global_step, last.is_symlink(),
                              torch.load(last, weights_only=True)["global_step"],
                              torch.load(best, weights_only=True)["global_step"]))

    checkpoints = LinkingModelCheckpoint(
        dirpath=tmp_path, filename="best", monitor="val/loss", mode="min", save_top_k=1,
        save_last=True, auto_insert_metric_name=False, enable_version_counter=False,
        save_on_train_epoch_end=False)
    data = DataLoader(torch.ones(8, 1), batch_size=1)
    trainer = L.Trainer(max_steps=3, val_check_interval=1, limit_val_batches=1,
                        callbacks=[checkpoints, Inspect()], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu")
    trainer.fit(_ScriptedValLoss([2.0, 3.0, 1.0]), data, data)
    assert Inspect.seen == [(1, True, 1, 1), (2, False, 2, 1), (3, True, 3, 3)]
    assert os.readlink(tmp_path / "last.ckpt") == "best.ckpt"
