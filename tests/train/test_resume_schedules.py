"""Resume is the uninterrupted run, schedules included: a run stopped by SIGTERM during
training, validation, evaluation or a checkpoint write, then resumed in place, logs the same
metrics (csv) and reports the same ``summary.json`` as a run that was never stopped: validations,
HellaSwag evaluations, samples and target tracking happen at the same steps."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from test_loggers import training_rows
from test_run import tiny_cfg

from minigpt.checkpoint.format import PROGRESS_KEYS
from minigpt.train.loop import Progress
from minigpt.train.run import run

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = ("the king walks to the river and the queen laughs at the old dog while a man reads "
         "letters by the fire in winter when snow falls on the quiet town").split()
# Validations at steps 2, 4, 6, 8; HellaSwag at every second one (steps 4 and 8); the target
# (a val/loss every run reaches) at the first.
SCHEDULE = ["data=local_files", "data.tokenizer=gpt2", "data.val_tokens=128",
            "trainer.max_steps=8", "trainer.val_check_interval=2", "eval.every=2",
            "eval.limit=3", "trainer.target_val_loss=20", "logger=csv",
            "sample.max_new_tokens=4"]
# Columns and summary fields that measure the machine, not the training.
CLOCK_FIELDS = ("seconds",)


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    """A data root with a small GPT-2-tokenized corpus and a HellaSwag-format file, the
    overrides that use them, and the directory of a run that was never stopped."""
    from minigpt.data import prepare_dataset

    root = tmp_path_factory.mktemp("gpt2-data")
    g = torch.Generator().manual_seed(0)
    text = " ".join(WORDS[i] for i in torch.randint(len(WORDS), (20_000,), generator=g).tolist())
    (root / "corpus").mkdir()
    (root / "corpus" / "story.txt").write_text(text)
    items = root / "hs.jsonl"
    items.write_text("".join(json.dumps(
        {"ctx": f"the king walks to the river and {w}", "label": i % 4,
         "endings": ["laughs.", "reads letters.", "falls on the town.", "walks."]}) + "\n"
        for i, w in enumerate(("the queen", "a man", "the dog"))))
    overrides = [*SCHEDULE, f"data.paths=[{root / 'corpus'}/*.txt]", f"eval.path={items}"]
    prepare_dataset(tiny_cfg(root, *overrides).data, root, progress=False)
    run(tiny_cfg(root, *overrides), root / "straight")
    return root, overrides, root / "straight"


class SignalDuring:
    """SIGTERM to this process while the loop runs ``part`` (``train``, ``validate``,
    ``evaluate`` or ``write``: a checkpoint) at step ``step``; the loop finishes the step,
    saves ``last.ckpt`` and exits 143."""

    def __init__(self, part: str, step: int):
        self.part, self.step = part, step

    def on_train_step_end(self, loop, loss):
        if loop.progress.global_step != self.step:
            return
        if self.part == "train":
            return os.kill(os.getpid(), signal.SIGTERM)
        owner = loop.checkpoints if self.part == "write" else loop
        original = getattr(owner, self.part)

        def signalled(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
            setattr(owner, self.part, original)  # once
            return original(*args, **kwargs)

        setattr(owner, self.part, signalled)


def assert_same_rows(got: list[dict], expected: list[dict]) -> None:
    """The same rows and cells; numbers to float32 rounding (as the weights of a resumed run,
    tests/train/test_run.py: a gradient norm may differ in its last bit)."""
    assert [sorted(k for k, v in r.items() if v) for r in got] == \
        [sorted(k for k, v in r.items() if v) for r in expected]
    for a, b in zip(got, expected, strict=True):
        assert {k: float(v) for k, v in a.items() if v} == \
            pytest.approx({k: float(v) for k, v in b.items() if v}, rel=1e-6), a["step"]


def summary_without_clock(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["target"] = {k: v for k, v in summary["target"].items() if k not in CLOCK_FIELDS}
    return {k: v for k, v in summary.items() if k not in ("run_dir", "last", "best")}


@pytest.mark.parametrize("part, step", [("train", 3), ("validate", 4), ("evaluate", 4),
                                        ("write", 6)])
def test_a_stopped_and_resumed_run_is_the_uninterrupted_run(tmp_path, gpt2_run, part, step):
    root, overrides, straight = gpt2_run
    stopped = tmp_path / "stopped"
    with pytest.raises(SystemExit) as exit_info:
        run(tiny_cfg(root, *overrides), stopped, callbacks=[SignalDuring(part, step)])
    assert exit_info.value.code == 143
    last = stopped / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == step
    run(tiny_cfg(root, *overrides, f"ckpt_path={last}"), stopped)

    expected = summary_without_clock(straight)
    assert expected["target"]["steps"] == 2 and "eval/hellaswag/acc" in expected
    assert summary_without_clock(stopped) == expected
    rows = training_rows(straight)
    assert [int(r["step"]) for r in rows if r.get("eval/hellaswag/acc")] == [4, 8]
    assert_same_rows(training_rows(stopped), rows)
    samples = (straight / "samples.txt").read_text()
    assert samples.count("--- step") == 4 and (stopped / "samples.txt").read_text() == samples


def test_an_older_checkpoint_without_counters_derives_them_from_the_step():
    stored = {"global_step": 6, "best_val_loss": 2.5, "val_loss": 2.75}  # before the counters
    assert set(stored) < set(PROGRESS_KEYS)
    assert Progress.restored(stored, val_every=2) == Progress(6, 2.5, 2.75, validations=3)
    full = Progress(6, 2.5, 2.75, 3, 1.5, {"steps": 2}, {"eval/hellaswag/acc": 0.5})
    assert Progress.restored(asdict(full), val_every=4) == full
