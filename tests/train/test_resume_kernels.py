"""A float32 CPU run resumed from its checkpoint multiplies with the kernels the run so far used
(stored in the checkpoint's metadata), not the ones this start-up's timings file favours: its
losses and weights equal the uninterrupted run's bit for bit. A checkpoint without the record
(written before it existed) resumes as before, measuring."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from test_run import LossRecorder, data_root, tiny_cfg  # noqa: F401 (data_root: a fixture, used by name)

import minigpt.cpu
import minigpt.cpu.tuning
from minigpt.cpu import onednn
from minigpt.train.run import run

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not onednn.available(), reason="PyTorch built without oneDNN")]

ONEDNN, DEFAULT = {"mkl": 1.0, "onednn": 0.1}, {"mkl": 0.1, "onednn": 1.0}
# dropout > 0 so the restored RNG states matter; decay_steps pinned so the half run has the
# same LR schedule as the full one (as in test_run's exact-resume test).
# 96 wide: oneDNN's and PyTorch's default GEMMs round some of these shapes differently on the
# CPUs tried (at 32 wide both summed alike); the test checks that they do here.
COMMON = ["model.dropout=0.1", "optim.decay_steps=8", "model.n_embd=96"]
STORED = "as stored in the checkpoint"


@pytest.fixture
def timings(tmp_path, monkeypatch):
    """``favour(seconds)``: what measuring finds from now on, for every training shape; returns
    the keys measured so far (a list per measurement) and the timings file."""
    cache = tmp_path / "minigpt-cache"
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(cache))
    monkeypatch.delenv("MINIGPT_CPU_RETUNE", raising=False)
    monkeypatch.setattr(minigpt.cpu.tuning, "load_per_core", lambda: 0.0)  # a quiet machine
    measured = []

    def favour(seconds: dict) -> list:
        def measure_matmuls(shapes):
            measured.append(sorted(shapes))
            return {key: dict(seconds) for key in shapes}
        monkeypatch.setattr(minigpt.cpu, "measure_matmuls", measure_matmuls)
        return measured

    favour.file = cache / minigpt.cpu.tuning.FILE_NAME
    return favour


def forge(path, seconds: dict) -> int:
    """Rewrite every stored timing of the file at ``path`` to ``seconds``; how many."""
    everything = json.loads(path.read_text())
    count = 0
    for known in everything.values():
        for entry in known.values():
            entry["seconds"] = dict(seconds)
            count += 1
    path.write_text(json.dumps(everything))
    return count


def speedups_line(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cpu speedups:")]
    assert len(lines) == 1, lines
    caplog.clear()
    return lines[0]


def test_a_float32_resume_applies_the_stored_kernels_bit_for_bit(
        tmp_path, data_root, timings, caplog):  # noqa: F811 (the fixture imported above)
    caplog.set_level(logging.INFO)
    measured = timings(ONEDNN)
    straight, first, second = LossRecorder(), LossRecorder(), LossRecorder()
    full = run(tiny_cfg(data_root, *COMMON), tmp_path / "full", callbacks=[straight])
    half = run(tiny_cfg(data_root, *COMMON, "trainer.max_steps=4"), tmp_path / "half",
               callbacks=[first])
    assert len(measured) == 1  # the half run read the file the full run wrote
    stored = torch.load(half["last"], weights_only=True)["minigpt"]["cpu_kernels"]
    assert stored["lm_head_loss_onednn"] is True and stored["matmuls"]
    assert set(stored["matmuls"].values()) == {"onednn"}
    caplog.clear()

    # The timings file now favours PyTorch's default for every shape, and so would measuring.
    assert forge(timings.file, DEFAULT) == len(stored["matmuls"])
    timings(DEFAULT)
    resumed = run(tiny_cfg(data_root, *COMMON, f"ckpt_path={half['last']}"), tmp_path / "resumed",
                  callbacks=[second])
    assert len(measured) == 1  # nothing measured on resume
    line = speedups_line(caplog)
    assert f"linear layers ({STORED})" in line and f"(oneDNN GEMMs, {STORED})" in line
    assert list(second.losses) == [5, 6, 7, 8]
    expect = [straight.losses[s] for s in range(1, 9)]
    got = [first.losses[s] for s in range(1, 5)] + [second.losses[s] for s in range(5, 9)]
    assert got == expect  # bit for bit
    assert resumed["val_loss"] == full["val_loss"]
    a = torch.load(full["last"], weights_only=True)
    b = torch.load(resumed["last"], weights_only=True)
    for key in a["model"]:
        assert torch.equal(b["model"][key], a["model"][key]), key
    assert b["minigpt"]["cpu_kernels"] == stored  # the resumed run's checkpoint keeps them

    # Without the record (an older checkpoint), the same resume takes the file's kernels: the
    # weights come out different, so the equality above is the stored kernels' doing.
    old = torch.load(half["last"], weights_only=True)
    del old["minigpt"]["cpu_kernels"]
    torch.save(old, tmp_path / "old.ckpt")
    other = run(tiny_cfg(data_root, *COMMON, f"ckpt_path={tmp_path / 'old.ckpt'}"),
                tmp_path / "other")
    assert STORED not in speedups_line(caplog)
    c = torch.load(other["last"], weights_only=True)["model"]
    assert not all(torch.equal(c[key], a["model"][key]) for key in a["model"]), \
        "oneDNN and PyTorch's default GEMMs round alike on this CPU: nothing was told apart"


def test_a_checkpoint_without_stored_kernels_resumes_measuring(
        tmp_path, data_root, timings, caplog):  # noqa: F811 (the fixture imported above)
    measured = timings(ONEDNN)
    half = run(tiny_cfg(data_root, *COMMON, "trainer.max_steps=4"), tmp_path / "half")
    old = torch.load(half["last"], weights_only=True)
    del old["minigpt"]["cpu_kernels"]  # as written before the record existed
    torch.save(old, tmp_path / "old.ckpt")
    timings.file.unlink()  # another machine: nothing measured yet
    timings(DEFAULT)
    caplog.set_level(logging.INFO)
    caplog.clear()
    resumed = run(tiny_cfg(data_root, *COMMON, f"ckpt_path={tmp_path / 'old.ckpt'}"),
                  tmp_path / "resumed")
    assert resumed["steps"] == 8 and len(measured) == 2
    line = speedups_line(caplog)
    assert "as stored" not in line and "in 0 of 9 linear layers" in line and "measured" in line
    kernels = torch.load(resumed["last"], weights_only=True)["minigpt"]["cpu_kernels"]
    assert set(kernels["matmuls"].values()) == {"mkl"} and not kernels["lm_head_loss_onednn"]


def test_a_bf16_run_stores_no_kernels(
        tmp_path, data_root, timings):  # noqa: F811 (the fixture imported above)
    measured = timings(ONEDNN)
    summary = run(tiny_cfg(data_root, *COMMON, "trainer.max_steps=2",
                           "trainer.val_check_interval=2", "trainer.precision=bf16-mixed"),
                  tmp_path / "bf16")
    assert measured == []
    assert "cpu_kernels" not in torch.load(summary["last"], weights_only=True)["minigpt"]
