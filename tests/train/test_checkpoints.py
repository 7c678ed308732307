"""minigpt.train.checkpoints: files written whole or not at all, ``last`` linked to ``best`` when
they hold the same state, leftovers of a killed run removed, Lightning-era checkpoints resumed."""

import os

import pytest
import torch
from lightning.fabric import Fabric

from minigpt.train.checkpoints import CheckpointFiles


@pytest.fixture
def files(tmp_path):
    return CheckpointFiles(Fabric(accelerator="cpu", devices=1), tmp_path / "checkpoints")


def test_a_write_is_whole_or_not_at_all(files, monkeypatch):
    path = files.write("last.ckpt", {"step": 1})
    assert torch.load(path, weights_only=True) == {"step": 1}

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        files.write("last.ckpt", {"step": 2})
    assert torch.load(path, weights_only=True) == {"step": 1}
    # the half-written temporary file is hidden, and the next run removes it
    leftovers = [p.name for p in files.directory.iterdir() if p.name != "last.ckpt"]
    assert all(name.startswith(".") and name.endswith(".tmp") for name in leftovers)
    files.remove_leftovers()
    assert [p.name for p in files.directory.iterdir()] == ["last.ckpt"]


def test_last_links_to_best_and_a_later_write_replaces_the_link(files):
    files.write("best.ckpt", {"step": 1})
    files.link_last_to_best()
    last = files.directory / "last.ckpt"
    assert last.is_symlink() and os.readlink(last) == "best.ckpt"
    files.write("last.ckpt", {"step": 2})  # replaces the link, never writes through it
    assert not last.is_symlink()
    assert torch.load(files.directory / "best.ckpt", weights_only=True) == {"step": 1}
    assert torch.load(last, weights_only=True) == {"step": 2}


def test_a_directory_of_shards_replaces_a_file_and_the_reverse(files, tmp_path):
    from minigpt.train.checkpoints import _replace

    shards = tmp_path / "new"
    shards.mkdir()
    (shards / "meta.pt").write_bytes(b"x")
    target = files.write("last.ckpt", {"step": 1})
    _replace(shards, target)
    assert (target / "meta.pt").read_bytes() == b"x"
    again = tmp_path / "again"
    again.mkdir()
    _replace(again, target)  # a directory over a directory: the old one is gone
    assert target.is_dir() and not list(target.iterdir())
    assert not [p for p in files.directory.iterdir() if p.name.startswith(".")]


def test_lightning_era_checkpoint_resumes(tmp_path, checkpoint_v1):
    """The Trainer's checkpoint (the text fixture): weights, AdamW state, schedule, data position
    and RNG come back through ``restore``."""
    from minigpt.checkpoint import load_checkpoint
    from minigpt.data import TokenDataModule
    from minigpt.train.checkpoints import restore
    from minigpt.train.loop import ModelWithLoss
    from minigpt.train.optim import adamw_with_schedule
    from minigpt.train.resume import read_resume_point

    model, _, meta = load_checkpoint(checkpoint_v1)
    fresh = type(model)(model.config)
    fabric = Fabric(accelerator="cpu", devices=1)
    module = fabric.setup_module(ModelWithLoss(fresh))
    optim = {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 1, "decay_steps": 10,
             "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8}
    optimizer, scheduler = adamw_with_schedule(module, optim, fused=False)
    optimizer = fabric.setup_optimizers(optimizer)
    data = TokenDataModule({"name": "x", "source": "shakespeare", "tokenizer": "char",
                            "batch_size": 2}, context_length=16, seed=1337, data_root=tmp_path)
    restored = restore(fabric, read_resume_point(checkpoint_v1, 10), module,
                       {"optimizer": optimizer}, {"optimizer": scheduler}, data)
    assert restored["global_step"] == 3 and restored["rng"] is not None
    for a, b in zip(fresh.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert data.start_batch == 3 and scheduler.last_epoch == 3
    assert all(len(optimizer.state[p]) for p in fresh.parameters())  # Adam moments are back
