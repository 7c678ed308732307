"""A run resumed in its own directory continues its logs: the CSV log reads as one uninterrupted
run (checked against a run that was never interrupted), and wandb continues the same run id."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from test_run import data_root, tiny_cfg  # noqa: F401 (data_root: a fixture, used by name)

from minigpt.config.schema import LoggerSchema
from minigpt.train.loggers import ContinuedCSV, WandbRun
from minigpt.train.run import run

# Columns that measure the machine (throughput, elapsed time), not the training.
CLOCK = ("per_s", "time", "mfu", "seconds")
CSV_LOG = ("logger=csv",)


class CrashAt:
    """Raises after optimizer step ``step`` is taken, before it is logged: the steps before it
    are in the log, past the last checkpoint."""

    def __init__(self, step: int):
        self.step = step

    def on_train_step_end(self, loop, loss):
        if loop.progress.global_step == self.step:
            raise RuntimeError("the machine went away")


def training_rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        return [{k: v for k, v in row.items() if not any(c in k for c in CLOCK)}
                for row in csv.DictReader(f)]


def test_a_run_resumed_in_place_logs_like_an_uninterrupted_one(
        tmp_path, data_root, one_thread):  # noqa: F811 (the fixture imported above)
    straight = tmp_path / "straight"
    run(tiny_cfg(data_root, *CSV_LOG), straight)
    resumed = tmp_path / "resumed"
    with pytest.raises(RuntimeError, match="went away"):
        run(tiny_cfg(data_root, *CSV_LOG), resumed, callbacks=[CrashAt(7)])  # last.ckpt is at step 4
    steps = [int(r["step"]) for r in training_rows(resumed)]
    assert max(steps) == 6  # steps 5 and 6 were logged after the checkpoint
    run(tiny_cfg(data_root, *CSV_LOG, f"ckpt_path={resumed / 'checkpoints' / 'last.ckpt'}"),
        resumed)

    expected = training_rows(straight)
    assert {"train/loss", "val/loss", "step"} <= set(expected[0])
    assert [int(r["step"]) for r in expected] == [1, 2, 3, 4, 4, 5, 6, 7, 8, 8]  # train, val
    assert training_rows(resumed) == expected
    assert not (resumed / ".metrics.csv.resuming").exists()


def write_log(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)


EARLIER = [{"step": 1, "train/loss": "4.25"}, {"step": 2, "train/loss": "4.0"},
           {"step": 2, "val/loss": "3.9375"}, {"step": 3, "train/loss": "3.5"}]


def test_rows_past_the_checkpoint_are_dropped_and_the_rest_kept_as_written(tmp_path):
    log = tmp_path / "csv" / "metrics.csv"
    write_log(log, EARLIER)
    table = ContinuedCSV(tmp_path, resume_step=2)
    assert table.start({}) == f"{log}: dropped 1 row(s) past step 2 that the interrupted run wrote"
    table.log_metrics({"train/loss": 3.75}, step=3)
    table.finalize("success")
    assert log.read_text().splitlines() == [
        "step,train/loss,val/loss", "1,4.25,", "2,4.0,", "2,,3.9375", "3,3.75,"]


def test_a_resume_that_died_while_writing_the_rows_back_loses_none(tmp_path):
    log = tmp_path / "csv" / "metrics.csv"
    write_log(tmp_path / ".metrics.csv.resuming", EARLIER)  # moved aside, then the process died
    write_log(log, EARLIER[:1])  # and only part of it was written back
    assert ContinuedCSV(tmp_path, resume_step=3).start({}) is None
    assert [r["step"] for r in csv.DictReader(log.open())] == ["1", "2", "2", "3"]
    assert not (tmp_path / ".metrics.csv.resuming").exists()


def test_a_new_run_or_no_earlier_log_starts_an_empty_log(tmp_path):
    log = tmp_path / "csv" / "metrics.csv"
    assert ContinuedCSV(tmp_path, resume_step=5).start({}) is None  # nothing to continue
    assert not log.exists()
    write_log(log, EARLIER)
    assert ContinuedCSV(tmp_path, resume_step=None).start({}) is None  # a new run: untouched
    assert len(log.read_text().splitlines()) == 5


def test_wandb_continues_the_run_it_logged_to_when_resumed_in_place(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = LoggerSchema(type="wandb", project="minigpt-test")
    first = WandbRun(cfg, tmp_path)
    assert first.start({"a": 1}).startswith("wandb: offline run ")
    run_id = first.run.id
    first.finalize("failed")
    assert (tmp_path / "wandb" / "run_id").read_text().strip() == run_id

    calls = []
    init = wandb.init
    monkeypatch.setattr(wandb, "init", lambda **kw: calls.append(kw) or init(**kw))
    resumed = WandbRun(cfg, tmp_path, resume_step=4)
    assert f"run {run_id} continued" in resumed.start({"a": 1})
    resumed.finalize("success")
    assert calls[0]["id"] == run_id and calls[0]["resume"] == "allow"
