"""A checkpoint written while float32 CPU runs stored their timed kernels (metadata key
``cpu_kernels``, no longer written or read) still loads for generation and resumes: the resumed
run's losses equal the uninterrupted run's bit for bit, and its own checkpoints drop the key."""

from __future__ import annotations

import pytest
import torch
from test_run import LossRecorder, data_root, tiny_cfg  # noqa: F401 (data_root: a fixture, used by name)

from minigpt.checkpoint import load_checkpoint
from minigpt.checkpoint.restore import read_resume_point
from minigpt.train.run import run

pytestmark = pytest.mark.usefixtures("one_thread")

# dropout > 0 so the restored RNG states matter; decay_steps pinned so the half run has the
# same LR schedule as the full one (as in test_run's exact-resume test).
COMMON = ["model.dropout=0.1", "optim.decay_steps=8"]
# The record as the removed code wrote it (minigpt.cpu.Applied.kernels).
OLD_RECORD = {"matmuls": {"train float32 512x32x96 forward": "onednn",
                          "train float32 512x32x96 weight grad": "mkl"},
              "lm_head_loss_onednn": True}


def test_a_checkpoint_with_the_old_kernel_record_loads_and_resumes_bit_for_bit(
        tmp_path, data_root):  # noqa: F811 (the fixture imported above)
    straight, first, second = LossRecorder(), LossRecorder(), LossRecorder()
    full = run(tiny_cfg(data_root, *COMMON), tmp_path / "full", callbacks=[straight])
    half = run(tiny_cfg(data_root, *COMMON, "trainer.max_steps=4"), tmp_path / "half",
               callbacks=[first])
    old = torch.load(half["last"], weights_only=True)
    assert "cpu_kernels" not in old["minigpt"]
    old["minigpt"]["cpu_kernels"] = OLD_RECORD
    path = tmp_path / "old.ckpt"
    torch.save(old, path)

    model, _, meta = load_checkpoint(path)  # generate.py's reader
    assert meta["cpu_kernels"] == OLD_RECORD and model.config.n_layer == 2
    assert read_resume_point(str(path), max_steps=8).step == 4
    resumed = run(tiny_cfg(data_root, *COMMON, f"ckpt_path={path}"), tmp_path / "resumed",
                  callbacks=[second])
    assert list(second.losses) == [5, 6, 7, 8]
    expect = [straight.losses[s] for s in range(1, 9)]
    got = [first.losses[s] for s in range(1, 5)] + [second.losses[s] for s in range(5, 9)]
    assert got == expect  # bit for bit
    assert resumed["val_loss"] == full["val_loss"]
    assert "cpu_kernels" not in torch.load(resumed["last"], weights_only=True)["minigpt"]
