"""minigpt.checkpoint.restore: a checkpoint is checked against the run before Lightning touches
it, and checkpoints of earlier versions (Lightning's Trainer) resume."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric

from minigpt.checkpoint import CheckpointError
from minigpt.checkpoint.restore import check_resume_matches, read_resume_point
from minigpt.errors import ConfigError


def test_resume_point_of_a_checkpoint(checkpoint_v1):
    point = read_resume_point(str(checkpoint_v1), max_steps=10)
    assert point.step == 3 and point.model_config["n_layer"] == 1
    assert point.tokenizer["type"] == "char"


@pytest.mark.parametrize("max_steps", [2, 3])
def test_a_checkpoint_at_or_past_max_steps_is_refused(checkpoint_v1, max_steps):
    with pytest.raises(ConfigError, match=rf"is at step 3; trainer.max_steps={max_steps}: raise "
                                          r"trainer.max_steps above 3 to continue"):
        read_resume_point(str(checkpoint_v1), max_steps=max_steps)


def test_mismatches_are_named_with_both_values_and_the_fix(checkpoint_v1):
    point = read_resume_point(str(checkpoint_v1), max_steps=10)
    run = {**point.model_config, "n_layer": 2, "dropout": 0.1}  # dropout may change on resume
    tokenizer = {**point.tokenizer, "chars": "ab", "vocab_size": 3}
    with pytest.raises(ConfigError) as error:
        check_resume_matches(point, run, tokenizer)
    message = str(error.value)
    assert "model.n_layer=2 here, 1 in the checkpoint" in message
    assert "dropout" not in message and "tokenizer is 'char' (3 ids) here, 'char' (81 ids)" in message
    assert f"model.init_from={checkpoint_v1}" in message and "\n" not in message
    check_resume_matches(point, {**point.model_config, "dropout": 0.1}, point.tokenizer)


def test_a_truncated_checkpoint_is_one_line(tmp_path, checkpoint_v1):
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(checkpoint_v1.read_bytes()[:20_000])
    with pytest.raises(CheckpointError, match=r"cut.ckpt is not a readable checkpoint") as error:
        read_resume_point(str(cut), max_steps=10)
    assert "weights_only=False" not in str(error.value)


def test_lightning_era_checkpoint_resumes(tmp_path, checkpoint_v1):
    """The Trainer's checkpoint (the text fixture): weights, AdamW state, schedule, data position
    and RNG come back through ``restore``."""
    from minigpt.checkpoint import load_checkpoint
    from minigpt.checkpoint.restore import restore
    from minigpt.data import TokenDataModule
    from minigpt.train.loop import ModelWithLoss
    from minigpt.train.optim import build_optimizers, schedule_for

    model, _, meta = load_checkpoint(checkpoint_v1)
    fresh = type(model)(model.config)
    fabric = Fabric(accelerator="cpu", devices=1)
    module = fabric.setup_module(ModelWithLoss(fresh))
    optim = {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 1, "decay_steps": 10,
             "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8}
    optimizer = build_optimizers(module, optim, fused=False)["optimizer"]
    scheduler = schedule_for(optimizer, optim)
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
