"""Every Hydra config composes and builds: model sizes on the meta device (no memory), trainers
that this machine can build, loggers; every YAML opens with a comment."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from minigpt.config import TrainSchema, typed
from minigpt.model import GPT
from minigpt.train.config import ConfigError, check_config
from minigpt.train.device import build_fabric
from minigpt.train.loggers import build_loggers
from minigpt.train.plan import batch_plan, resolve_plan

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def compose_train(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def test_every_yaml_opens_with_a_comment():
    files = sorted(CONFIGS.rglob("*.yaml"))
    assert len(files) >= 20
    for path in files:
        first = path.read_text().lstrip().splitlines()[0]
        assert first.startswith("#"), f"{path.relative_to(CONFIGS)} has no header comment"


def test_groups_have_the_promised_options():
    assert {"toy", "gpt2_small", "gpt2_medium", "gpt2_large", "gpt2_xl"} <= set(options("model"))
    assert {"auto", "cpu", "gpu", "ddp", "fsdp"} <= set(options("trainer"))
    assert {"wandb", "csv", "none"} <= set(options("logger"))
    assert {"shakespeare_char", "gpt2_owt"} <= set(options("experiment"))


def test_defaults_are_the_offline_quick_start():
    cfg = compose_train()
    assert (cfg.model.name, cfg.data.name, cfg.data.tokenizer) == ("toy", "shakespeare_char", "char")
    assert cfg.logger.type == "wandb" and cfg.trainer.accelerator == "auto"
    assert cfg.optim.decay_steps == cfg.trainer.max_steps
    check_config(cfg)


@pytest.mark.parametrize(("name", "millions"), [
    ("gpt2_small", 124.4), ("gpt2_medium", 354.8), ("gpt2_large", 774.0), ("gpt2_xl", 1557.6),
])
def test_gpt2_sizes_on_meta_device(name, millions):
    cfg = compose_train(f"model={name}")
    assert cfg.data.tokenizer == "gpt2"  # the GPT-2 sizes switch the data to GPT-2 BPE
    assert cfg.optim.lr == 6e-4  # ... and the learning rate to GPT-2's
    assert cfg.data.batch_size <= 8  # ... and a micro-batch that fits a GPU at 1024 tokens
    with torch.device("meta"):
        model = GPT(typed(cfg, TrainSchema).model.gpt_config(50257))
    assert model.num_params() / 1e6 == pytest.approx(millions, abs=0.1)
    check_config(cfg)


def test_command_line_data_wins_over_the_model_default():
    assert compose_train("model=gpt2_small", "data=openwebtext").data.name == "openwebtext"


@pytest.mark.parametrize("name", ["toy"])
def test_small_models_build_for_real(name):
    cfg = compose_train(f"model={name}")
    model = GPT(typed(cfg, TrainSchema).model.gpt_config(128))
    assert 1e5 < model.num_params() < 2e7


@pytest.mark.parametrize("experiment", options("experiment"))
def test_experiments_compose(experiment):
    cfg = compose_train(f"experiment={experiment}")
    if cfg.trainer.accelerator == "gpu" and not torch.cuda.is_available():
        # the machine check refuses a GPU recipe here; everything else must pass
        cfg = compose_train(f"experiment={experiment}", "trainer.accelerator=auto")
    check_config(cfg)
    assert cfg.optim.lr > cfg.optim.min_lr > 0


def test_gpt2_owt_is_nanogpt_like():
    cfg = compose_train("experiment=gpt2_owt")
    tokens = cfg.data.tokens_per_step
    assert 0.45e6 < tokens < 0.55e6 and cfg.trainer.accumulate_grad_batches == 1  # derived
    for gpus, accumulate in ((1, 40), (8, 5)):
        plan = batch_plan(tokens, 1, cfg.data.batch_size, cfg.model.context_length, gpus)
        assert plan.accumulate == accumulate and plan.tokens_per_step == tokens
    assert (cfg.model.name, cfg.data.name) == ("gpt2_small", "openwebtext")
    assert (cfg.optim.lr, cfg.optim.min_lr) == (6e-4, 6e-5) and cfg.optim.warmup_steps > 0


@pytest.mark.parametrize("trainer", options("trainer"))
def test_trainers_compose_and_build_where_possible(trainer, tmp_path):
    cfg = compose_train(f"trainer={trainer}", "logger=none")
    if cfg.trainer.accelerator == "gpu" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    plan = resolve_plan(typed(cfg, TrainSchema))
    fabric = build_fabric(typed(cfg, TrainSchema).trainer, plan, loggers=[])
    assert plan.precision in ("bf16-mixed", "16-mixed", "32-true")
    assert plan.with_world(fabric.world_size).world_size == fabric.world_size


def test_overrides_users_reach_for():
    cfg = compose_train(
        "trainer.max_steps=10", "trainer.devices=1", "trainer.num_nodes=1",
        "trainer.precision=32-true", "trainer.accumulate_grad_batches=2",
        "trainer.val_check_interval=5", "data.batch_size=8", "optim.lr=3e-4", "model.dropout=0.1",
        "seed=7", "ckpt_path=last", "compile=true", "model.init_from=/some/dir",
    )
    assert cfg.optim.decay_steps == 10 and cfg.model.dropout == 0.1 and cfg.compile
    check_config(cfg)


@pytest.mark.parametrize("logger", ["csv", "none"])
def test_loggers_build(logger, tmp_path):
    loggers = build_loggers(typed(compose_train(f"logger={logger}"), TrainSchema).logger, tmp_path)
    assert [type(lg).__name__ for lg in loggers] == (["ContinuedCSV"] if logger == "csv" else [])


def test_wandb_logger_builds_without_network(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    loggers = build_loggers(typed(compose_train("logger=wandb"), TrainSchema).logger, tmp_path)
    assert [type(lg).__name__ for lg in loggers] == ["ContinuedCSV", "WandbRun"]
    wandb_run = loggers[1]
    assert not list(tmp_path.iterdir())  # nothing written until the run starts
    try:
        assert wandb_run.start({"a": 1}).startswith("wandb: disabled run")
        wandb_run.log_metrics({"x": 1.0}, step=1)
    finally:
        wandb_run.finalize("success")
        import wandb

        wandb.teardown()  # its session keeps the WANDB_MODE it first saw


def test_fsdp_wraps_each_block():
    # FSDP needs CUDA; check the strategy we hand Fabric instead of running it.
    from minigpt.model import Block
    from minigpt.train.device import fsdp_strategy

    cfg = compose_train("trainer=fsdp", "trainer.precision=bf16-mixed")
    train = typed(cfg, TrainSchema)
    strategy = fsdp_strategy(resolve_plan(train, world_size=2), train.trainer.fsdp)
    assert type(strategy).__name__ == "FSDPStrategy"
    assert strategy._fsdp_kwargs["use_orig_params"] is True
    assert strategy._state_dict_type == "sharded"
    policy = strategy._fsdp_kwargs["auto_wrap_policy"]
    assert set(policy._module_classes) == {Block}
    # bf16 matmuls, but gradients reduced and buffers kept in float32
    mixed = strategy.mixed_precision
    assert (mixed.param_dtype, mixed.reduce_dtype, mixed.buffer_dtype) == \
        (torch.bfloat16, torch.float32, torch.float32)


def test_trainer_problems_are_config_errors():
    from minigpt.errors import ConfigError

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    train = typed(compose_train("trainer=fsdp"), TrainSchema)
    with pytest.raises(ConfigError, match="trainer.strategy=fsdp runs on GPUs and this machine has none"):
        build_fabric(train.trainer, resolve_plan(train), loggers=[])


@pytest.mark.parametrize("attention", options("attention"))
def test_attention_variants_compose_and_build(attention):
    cfg = compose_train(f"attention={attention}")
    check_config(cfg)
    model = GPT(typed(cfg, TrainSchema).model.gpt_config(128))
    assert model.num_params() > 1e6
    assert compose_train(f"attention={attention}", "model=gpt2_small").model.n_head == 12


def test_attention_fields_as_command_line_overrides():
    cfg = compose_train("model.num_kv_heads=1", "model.position=rope", "model.window=128")
    config = typed(cfg, TrainSchema).model.gpt_config(128)
    assert (config.kv_heads, config.position, config.window) == (1, "rope", 128)
    bad = compose_train("model.num_kv_heads=3", "model.window=0")
    with pytest.raises(ConfigError, match=r"window=0 must be .*; model.num_kv_heads=3 must divide num_heads=4"):
        check_config(bad)


def test_the_attention_lab_sweeps_every_variant():
    cfg = compose_train("experiment=attention_variants")
    assert cfg.logger.type == "csv" and cfg.model.name == "toy"
    assert cfg.trainer.max_steps == compose_train().trainer.max_steps  # the default budget
    swept = (CONFIGS / "experiment" / "attention_variants.yaml").read_text()
    assert f"attention: {','.join(sorted(options('attention'), key=_lab_order))}" in swept


def _lab_order(name: str) -> int:
    return ["gpt2", "gqa", "mqa", "rope", "window", "rope_window"].index(name)
