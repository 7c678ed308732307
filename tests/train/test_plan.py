"""minigpt.train.plan: tokens per step -> accumulation; the run's plan resolved once."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from minigpt.config import TrainSchema, typed
from minigpt.errors import ConfigError
from minigpt.train.plan import BatchPlan, batch_plan, micro_batches_per_step, resolve_plan

ROOT = Path(__file__).resolve().parents[2]


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


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


def test_the_plan_resolves_device_settings_and_the_batch_once():
    cpu = ("trainer.accelerator=cpu", "trainer.precision=32-true", "data.tokens_per_step=16384",
           "trainer.val_check_interval=50", "compile=false")
    plan = resolve_plan(typed(_cfg(*cpu), TrainSchema), world_size=1)
    assert (plan.accelerator, plan.precision, plan.compile) == ("cpu", "32-true", False)
    assert plan.cpu_speedups and plan.chunked_loss
    assert plan.batch == BatchPlan(32, 256, 2, 1) and plan.val_every == 50
    # the same command on 2 processes: half the micro-batches each, the same tokens per step
    two = plan.with_world(2)
    assert two.batch == BatchPlan(32, 256, 1, 2) and two.batch.tokens_per_step == 16384
    with pytest.raises(ConfigError, match="data.tokens_per_step=16384 is not a multiple"):
        plan.with_world(3)
    # a shorter context: more micro-batches for the same tokens per step
    short = typed(_cfg(*cpu, "model.context_length=128"), TrainSchema)
    assert resolve_plan(short, world_size=1).batch.accumulate == 4
    compiled = resolve_plan(typed(_cfg("trainer.accelerator=cpu", "compile=true"), TrainSchema),
                            world_size=1)
    assert compiled.compile and compiled.cpu_speedups and not compiled.chunked_loss
