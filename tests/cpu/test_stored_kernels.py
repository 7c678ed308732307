"""The float32 kernel decisions of ``speed_up_training`` (``Applied.kernels``), which a checkpoint
stores: applied again as stored, without measuring, whatever the timings file says now."""

from __future__ import annotations

import pytest
from test_speedups import FASTER, SLOWER, plain_and_fast

from minigpt.cpu import onednn
from minigpt.cpu.linear import MATMULS, OneDNNLinear

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not onednn.available(), reason="PyTorch built without oneDNN")]


def onednn_ops(model) -> dict[str, frozenset]:
    """Each swapped layer's name and the matmuls it runs on oneDNN."""
    return {name: m.ops for name, m in model.named_modules() if isinstance(m, OneDNNLinear)}


def test_the_decisions_taken_are_returned_with_what_was_applied(fake_timings):
    fake_timings(train={"forward": FASTER, "input grad": SLOWER, "weight grad": FASTER})
    _, fast, applied = plain_and_fast()
    matmuls = applied.kernels["matmuls"]
    assert len(matmuls) == 5 * 3  # five shapes (in x out), three matmuls each
    assert all(sum(key.endswith(op) for key in matmuls) == 5 for op in MATMULS)
    for key, kernel in matmuls.items():
        assert kernel == ("mkl" if key.endswith("input grad") else "onednn"), key
    # the head's three matmuls summed: 3 s on PyTorch's default against 0.5 + 2 + 0.5 on oneDNN
    assert applied.kernels["lm_head_loss_onednn"] is False is fast.next_token_loss.onednn


def another_machine(monkeypatch, tmp_path, fake_timings, favoured: dict) -> list:
    """A fresh timings file whose measurements find ``favoured``; the measurements it takes."""
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path / "another-machine"))
    calls = fake_timings(train={op: favoured for op in MATMULS})
    calls.clear()
    return calls


def test_stored_decisions_are_applied_without_measuring(fake_timings, monkeypatch, tmp_path):
    fake_timings(train={op: FASTER for op in MATMULS})
    _, measured_model, measured = plain_and_fast()
    calls = another_machine(monkeypatch, tmp_path, fake_timings, SLOWER)
    _, fast, applied = plain_and_fast(stored_kernels=measured.kernels)
    assert calls == []  # nothing measured
    assert onednn_ops(fast) == onednn_ops(measured_model) and len(onednn_ops(fast)) == 9
    assert fast.next_token_loss.onednn is True
    assert applied.kernels == measured.kernels  # a resume's checkpoint stores them again
    assert applied == ["oneDNN float32 matmuls in 9 of 9 linear layers (as stored in the "
                       "checkpoint)", "chunked LM-head loss (oneDNN GEMMs, as stored in the "
                       "checkpoint)"]


def test_stored_default_kernels_swap_nothing(fake_timings, monkeypatch, tmp_path):
    fake_timings(train={op: SLOWER for op in MATMULS})
    _, _, measured = plain_and_fast()
    calls = another_machine(monkeypatch, tmp_path, fake_timings, FASTER)
    _, fast, applied = plain_and_fast(stored_kernels=measured.kernels)
    assert calls == [] and onednn_ops(fast) == {} and fast.next_token_loss.onednn is False
    assert applied[-1] == "chunked LM-head loss (PyTorch default GEMMs, as stored in the checkpoint)"


@pytest.mark.parametrize("stored", [
    "onednn", {"matmuls": {"a": "onednn"}}, {"matmuls": {"a": "cublas"}, "lm_head_loss_onednn": True},
    {"matmuls": [], "lm_head_loss_onednn": False}, {"matmuls": {}, "lm_head_loss_onednn": "yes"}])
def test_a_malformed_record_is_ignored_and_the_kernels_measured(fake_timings, stored):
    calls = fake_timings(train={op: FASTER for op in MATMULS})
    _, fast, applied = plain_and_fast(stored_kernels=stored)
    assert len(calls) == 1 and len(onednn_ops(fast)) == 9
    assert "as stored" not in " ".join(applied) and "measured" in applied[0]


def test_no_decisions_without_float32(fake_timings):
    fake_timings(train={op: FASTER for op in MATMULS})
    for precision in ("bf16-mixed", "16-mixed"):
        assert plain_and_fast(precision=precision)[2].kernels is None
    assert plain_and_fast(compiled=True)[2].kernels is None
