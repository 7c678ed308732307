"""A run with ``model.window_schedule``: the loop sets each step's window from the step counter,
so a run stopped mid-schedule and resumed trains with the windows (and losses) of a run that
was never stopped."""

from __future__ import annotations

import signal

import pytest
import torch
from test_run import SignalAt, data_root, tiny_cfg  # noqa: F401  (data_root: a fixture)

from minigpt.train.run import run

pytestmark = pytest.mark.usefixtures("one_thread")
SCHEDULED = ["model.window_schedule=[8,16,32]", "trainer.max_steps=6",
             "trainer.val_check_interval=3"]


class WindowRecorder:
    """Each optimizer step's window and loss (a Fabric callback)."""

    def __init__(self):
        self.steps: dict[int, tuple[int, float]] = {}

    def on_train_step_end(self, loop, loss):
        window = int(loop.model.attention_layers()[0].live_window)
        self.steps[loop.progress.global_step] = (window, float(loss))


def test_the_window_follows_the_step_through_a_resume(data_root, tmp_path):  # noqa: F811
    straight = WindowRecorder()
    run(tiny_cfg(data_root, *SCHEDULED), tmp_path / "straight", callbacks=[straight])
    assert [w for w, _ in straight.steps.values()] == [8, 8, 16, 16, 32, 32]

    stopped = WindowRecorder()
    with pytest.raises(SystemExit):
        run(tiny_cfg(data_root, *SCHEDULED), tmp_path / "stopped",
            callbacks=[stopped, SignalAt(3, signal.SIGTERM)])
    last = tmp_path / "stopped" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 3
    run(tiny_cfg(data_root, *SCHEDULED, f"ckpt_path={last}"), tmp_path / "stopped",
        callbacks=[stopped])
    assert [s for s in stopped.steps] == [1, 2, 3, 4, 5, 6]
    for step, (window, loss) in straight.steps.items():
        assert stopped.steps[step][0] == window
        assert stopped.steps[step][1] == pytest.approx(loss, rel=1e-5), step


def test_a_bad_schedule_stops_the_run_before_any_work(data_root, tmp_path):  # noqa: F811
    with pytest.raises(Exception, match=r"model\.window_schedule=\[8, 16\] must end at the full "
                                        r"context_length=32"):
        run(tiny_cfg(data_root, "model.window_schedule=[8,16]"), tmp_path / "bad")
    assert not (tmp_path / "bad" / "checkpoints").exists()
