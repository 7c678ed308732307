"""data.batch_size=auto on the CPU (the preflight's estimate against trainer.memory_budget), the
preflight's refusal naming what fits, and an out-of-memory error mid-run answered in one line
and resumed with the smaller micro-batch it names. The oracles are linear scans of the estimate
(not the search) and the runs' own records."""

from __future__ import annotations

import hashlib
import json
import re

import pytest
import torch
import yaml
from test_run import tiny_cfg

from minigpt.config import TrainSchema, typed
from minigpt.errors import USER_ERROR_EXIT_CODE, ConfigError, ResourceError, one_line_errors
from minigpt.train.memory import check_run_fits, plan_estimate
from minigpt.train.plan import (
    ESTIMATE_HEADROOM,
    choose_from_estimate,
    keep_global_batch,
    resolve_plan,
)
from minigpt.train.run import run

pytestmark = pytest.mark.usefixtures("one_thread")

BUDGET = "3MB"  # the tiny model's step fits 8 rows of 32 tokens in it, with the headroom
MODEL_VOCAB = 128  # shakespeare_char's vocabulary, padded


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    from minigpt.data import prepare_dataset

    root = tmp_path_factory.mktemp("data")
    prepare_dataset(tiny_cfg(root).data, root, progress=False)
    return root


def _plan(*overrides: str, world_size: int = 1):
    train = typed(tiny_cfg("unused", *overrides), TrainSchema)
    return resolve_plan(train, world_size), train.model.gpt_config(MODEL_VOCAB).to_dict()


def _largest_by_scan(plan, model, limit: int, rows: int | None = None, *, headroom=1.0,
                     checkpointing=None) -> int:
    """The oracle: every size from 1 up, the largest whose estimate fits (dividing ``rows``)."""
    sizes = [n for n in range(1, 257) if (rows is None or rows % n == 0) and plan_estimate(
        plan, model, n, activation_checkpointing=checkpointing).total * headroom <= limit]
    return max(sizes, default=0)


def test_auto_picks_the_largest_estimated_size_under_the_budget():
    plan, model = _plan("data.batch_size=auto", f"trainer.memory_budget={BUDGET}")
    choice = choose_from_estimate(plan, model)
    expected = _largest_by_scan(plan, model, 3_000_000, headroom=ESTIMATE_HEADROOM)
    assert choice.batch_size == expected == 8
    assert "trainer.memory_budget" in choice.reason and "rounded" not in choice.reason


def test_auto_rounds_down_to_divide_the_rows_of_tokens_per_step():
    plan, model = _plan("data.batch_size=auto", f"trainer.memory_budget={BUDGET}",
                        "data.tokens_per_step=384")  # 12 rows of 32 tokens
    choice = choose_from_estimate(plan, model)
    assert choice.batch_size == _largest_by_scan(plan, model, 3_000_000, 12,
                                                 headroom=ESTIMATE_HEADROOM) == 6
    assert "8 would fit, rounded down to divide the 12 rows" in choice.reason
    chosen = plan.with_batch_size(choice.batch_size).batch
    assert (chosen.accumulate, chosen.tokens_per_step) == (2, 384)


def test_auto_refuses_when_not_even_one_row_fits():
    plan, model = _plan("data.batch_size=auto", "trainer.memory_budget=100KB")
    with pytest.raises(ResourceError, match="trainer.memory_budget"):
        choose_from_estimate(plan, model)


def test_resume_keeps_the_checkpoints_global_batch():
    stored = {"batch_size": 4, "accumulate": 1, "tokens_per_step": 128}
    plan, _ = _plan("data.batch_size=2")
    kept, line = keep_global_batch(plan, stored)
    assert (kept.batch.batch_size, kept.batch.accumulate, kept.batch.tokens_per_step) == (2, 2, 128)
    assert "128 tokens per step" in line
    same, line = keep_global_batch(_plan("data.batch_size=4")[0], stored)
    assert line is None and same.batch.tokens_per_step == 128
    given, line = keep_global_batch(_plan("data.batch_size=2", "data.tokens_per_step=64")[0],
                                    stored)
    assert line is None and given.batch.tokens_per_step == 64  # the command line's wins
    assert keep_global_batch(plan, None) == (plan, None)  # a checkpoint from before the record


def test_refusal_names_the_largest_micro_batch_and_checkpointing_that_fit():
    plan, model = _plan("data.batch_size=16", "data.tokens_per_step=1536",
                        f"trainer.memory_budget={BUDGET}")  # 48 rows per step
    with pytest.raises(ResourceError) as error:
        check_run_fits(plan, model)
    message = str(error.value)
    sizes = {mode: _largest_by_scan(plan, model, 3_000_000, 48, checkpointing=mode)
             for mode in ("none", "selective", "blocks")}
    assert sizes == {"none": 8, "selective": 12, "blocks": 16}  # each a divisor of 48
    assert ("it fits with data.batch_size=8 data.tokens_per_step=1536, or with "
            "data.batch_size=12 data.tokens_per_step=1536 trainer.activation_checkpointing="
            "selective, or with data.batch_size=16 data.tokens_per_step=1536 "
            "trainer.activation_checkpointing=blocks; make it smaller") in message
    assert "\n" not in message


@pytest.mark.parametrize(("override", "phrase"), [
    ("data.batch_size=big", "data.batch_size='big' must be a positive integer or auto"),
    ("data.batch_size=0", "data.batch_size=0 must be a positive integer or auto"),
    ("trainer.memory_budget=lots", "trainer.memory_budget='lots' must be null, bytes"),
])
def test_bad_values_fail_before_training(tmp_path, data_root, override, phrase):
    with pytest.raises(ConfigError, match=re.escape(phrase)):
        run(tiny_cfg(data_root, override), tmp_path / "run")


def test_auto_run_records_its_choice_and_a_resume_keeps_the_global_batch(tmp_path, data_root,
                                                                          capsys):
    auto = ["data.batch_size=auto", f"trainer.memory_budget={BUDGET}", "trainer.max_steps=4",
            "trainer.val_check_interval=2"]
    summary = run(tiny_cfg(data_root, *auto), tmp_path / "run")
    out = capsys.readouterr().out
    assert "data.batch_size=auto chose 8: its estimated step" in out
    assert "batch: 8 x 32 tokens x 1 micro-batch(es)" in out
    assert summary["batch"] == json.loads((tmp_path / "run/summary.json").read_text())["batch"]
    assert summary["batch"]["batch_size"] == 8 and summary["batch"]["tokens_per_step"] == 256
    assert yaml.safe_load((tmp_path / "run/config.yaml").read_text())["data"]["batch_size"] == 8
    last = tmp_path / "run/checkpoints/last.ckpt"
    assert torch.load(last, weights_only=True)["batch"]["batch_size"] == 8

    # A smaller micro-batch on resume: the accumulation grows, the tokens per step stay.
    resumed = run(tiny_cfg(data_root, "data.batch_size=1", "trainer.max_steps=6",
                           "trainer.val_check_interval=2", f"ckpt_path={last}"),
                  tmp_path / "resumed")
    assert "resuming with the checkpoint's 256 tokens per step" in capsys.readouterr().out
    assert resumed["steps"] == 6
    assert {k: resumed["batch"][k] for k in ("batch_size", "accumulate", "tokens_per_step")} == \
        {"batch_size": 1, "accumulate": 8, "tokens_per_step": 256}


class OutOfMemoryAtStep:
    """Raises what CUDA raises when a step does not fit, at the first micro-batch of ``step``,
    after noting the bytes of the last checkpoint the run had written."""

    def __init__(self, step: int):
        self.step, self.last_checkpoint = step, None

    def on_train_batch_start(self, loop, micro):
        if loop.progress.global_step + 1 == self.step:
            last = loop.checkpoints.directory / "last.ckpt"
            self.last_checkpoint = hashlib.sha256(last.read_bytes()).hexdigest()
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_out_of_memory_mid_run_is_one_line_and_resumes_with_the_smaller_batch(tmp_path,
                                                                              data_root, capsys):
    recipe = ["data.batch_size=4", "data.tokens_per_step=256", "trainer.val_check_interval=2",
              "trainer.max_steps=6"]  # 4 rows x 2 micro-batches
    oom = OutOfMemoryAtStep(3)
    with pytest.raises(SystemExit) as exit_info, one_line_errors():  # train.py's handling
        run(tiny_cfg(data_root, *recipe), tmp_path / "run", callbacks=[oom])
    assert exit_info.value.code == USER_ERROR_EXIT_CODE
    line = capsys.readouterr().err.strip().splitlines()[-1]
    last = tmp_path / "run/checkpoints/last.ckpt"
    match = re.fullmatch(
        r"error: out of memory during training at step 3 \(OutOfMemoryError: CUDA out of memory\. "
        r"Tried to allocate 2\.00 GiB\); peak \d+\.\d\d GiB \(resident set\) with "
        r"data\.batch_size=4 x 2 micro-batch\(es\); it would fit with data\.batch_size=(\d) "
        r"data\.tokens_per_step=256, or trainer\.activation_checkpointing=blocks; resume "
        rf"from {re.escape(str(last))} with `python train.py ckpt_path={re.escape(str(last))} "
        r"data\.batch_size=\1 data\.tokens_per_step=256`", line)
    assert match, line
    smaller = int(match.group(1))
    assert smaller < 4 and 8 % smaller == 0  # divides the 8 rows of a step
    # The checkpoint of step 2 is the one the failed step found, byte for byte.
    assert hashlib.sha256(last.read_bytes()).hexdigest() == oom.last_checkpoint
    assert torch.load(last, weights_only=True)["global_step"] == 2

    resumed = run(tiny_cfg(data_root, *recipe, f"data.batch_size={smaller}", f"ckpt_path={last}"),
                  tmp_path / "resumed")
    assert resumed["steps"] == 6
    assert resumed["batch"]["tokens_per_step"] == 256
    assert resumed["batch"]["accumulate"] == 8 // smaller


def test_bench_fits_table_grows_with_the_card_and_the_recomputation():
    """bench.auto_batch --fits (the README's table) stays runnable and sensible."""
    from bench.auto_batch import CARDS_GIB, fits_table

    rows = fits_table()
    assert {(r["model"], r["checkpointing"]) for r in rows} == {
        (m, c) for m in ("GPT-2 small", "GPT-2 medium") for c in ("none", "selective", "blocks")}
    for r in rows:
        assert len(r["sizes"]) == len(CARDS_GIB) and r["sizes"] == sorted(r["sizes"])
        assert r["sizes"][0] >= 1
    by_mode = {(r["model"], r["checkpointing"]): r["sizes"] for r in rows}
    for model in ("GPT-2 small", "GPT-2 medium"):
        none, selective, blocks = (by_mode[model, c] for c in ("none", "selective", "blocks"))
        assert all(a < b < c for a, b, c in zip(none, selective, blocks, strict=True))
