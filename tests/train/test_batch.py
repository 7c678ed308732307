"""minigpt.train.batch: tokens per step -> accumulation, intervals in steps, resume counters."""

import pytest

from minigpt.train.batch import (
    BatchPlan,
    batch_plan,
    batches_between_checks,
    micro_batches_per_step,
    rescale_batch_progress,
)
from minigpt.train.config import ConfigError


def test_nanogpt_recipe_on_1_8_and_64_gpus():
    assert micro_batches_per_step(491520, 12, 1024, 1) == 40
    assert micro_batches_per_step(491520, 12, 1024, 8) == 5
    assert micro_batches_per_step(524288, 8, 1024, 64) == 1
    plan = batch_plan(491520, 1, 12, 1024, 8)
    assert plan == BatchPlan(12, 1024, 5, 8) and plan.tokens_per_step == 491520
    assert plan.describe() == "12 x 1024 tokens x 5 micro-batch(es) x 8 process(es) = 491,520 tokens per step"


def test_tokens_per_step_that_does_not_divide_is_one_line():
    with pytest.raises(ConfigError, match=r"^data.tokens_per_step=491520 is not a multiple of "
                       r"data.batch_size x context_length x processes = 12 x 1024 x 64 = 786432; "
                       r"fix: data.tokens_per_step=786432 or another data.batch_size$"):
        micro_batches_per_step(491520, 12, 1024, 64)


def test_accumulation_given_or_derived():
    assert batch_plan(None, 3, 4, 32, 2) == BatchPlan(4, 32, 3, 2)  # as configured
    assert batch_plan(1024, 4, 4, 32, 2).accumulate == 4  # agrees: fine
    with pytest.raises(ConfigError, match="accumulate_grad_batches=3 disagrees"):
        batch_plan(1024, 3, 4, 32, 2)


def test_intervals_count_optimizer_steps():
    assert batches_between_checks(2000, 40) == 80000
    assert batches_between_checks(None, 40) is None
    assert batches_between_checks("00:01:00:00", 4) == "00:01:00:00"


def _loops(processed: int, ready_extra: int = 0) -> dict:
    counters = {"ready": processed + ready_extra, "started": processed, "processed": processed,
                "completed": processed - 1}
    return {"fit_loop": {"epoch_loop.batch_progress": {"total": dict(counters),
                                                       "current": dict(counters)}}}


def test_resume_with_another_accumulation_rescales_lightnings_batch_counters():
    loops = _loops(processed=6)  # 3 steps of 2 micro-batches (2 processes), saved mid-hook
    assert rescale_batch_progress(loops, global_step=3, accumulate=4)  # now 1 process
    total = loops["fit_loop"]["epoch_loop.batch_progress"]["total"]
    assert total == {"ready": 12, "started": 12, "processed": 12, "completed": 11}
    assert not rescale_batch_progress(loops, global_step=3, accumulate=4)  # already right
    assert not rescale_batch_progress({}, global_step=3, accumulate=4)
