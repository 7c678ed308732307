"""The typed config's values: one rule table, every field of the optimizer and schedule in it,
the rules across fields, and one validation shared by ``GPTConfig`` and the model's schema."""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from minigpt.config import ModelSchema, OptimSchema, TrainerSchema, TrainSchema, typed
from minigpt.config.rules import TRAIN_RULES, train_problems
from minigpt.field_rules import OneOf, Range, Satisfies, field_problems, spell
from minigpt.model import GPT_CONFIG_RULES, GPTConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def train(*overrides: str) -> TrainSchema:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return typed(compose("train", overrides=list(overrides)), TrainSchema)


@pytest.mark.parametrize(("rule", "value", "holds"), [
    (Range(0, 1, high_open=True), 0, True), (Range(0, 1, high_open=True), 0.999, True),
    (Range(0, 1, high_open=True), 1, False), (Range(0, 1, high_open=True), -1e-9, False),
    (Range(0, 1, low_open=True), 0, False), (Range(0, 1, low_open=True), 1, True),
    (Range(1), 1, True), (Range(1), 0, False), (Range(0, low_open=True), math.inf, False),
    (Range(0), math.nan, False), (OneOf(("a", False)), False, True), (OneOf(("a",)), "b", False),
    (Satisfies(lambda v: v % 2 == 0, "even"), 4, True),
])
def test_rules_hold_where_they_should(rule, value, holds):
    assert rule.holds(value) is holds


def test_values_are_spelled_as_on_the_command_line():
    assert [spell(v) for v in (None, True, False, "x", 1.5)] == ["null", "true", "false", "'x'",
                                                                  "1.5"]


def test_every_number_and_choice_of_the_optimizer_and_trainer_has_a_rule():
    for prefix, schema in (("optim", OptimSchema), ("trainer", TrainerSchema)):
        hints = typing.get_type_hints(schema)
        for f in dataclasses.fields(schema):
            if hints[f.name] in (bool, typing.Any) or f.name in ("fused", "strategy",
                                                                 "accelerator", "precision"):
                continue  # true/false needs no range; Lightning names the rest
            if dataclasses.is_dataclass(hints[f.name]):
                continue
            assert f"{prefix}.{f.name}" in TRAIN_RULES, f"{prefix}.{f.name} has no rule"


@pytest.mark.parametrize(("override", "message"), [
    ("optim.muon_momentum=1.5", "optim.muon_momentum=1.5 must be a number in [0, 1)"),
    ("optim.muon_adjust_lr=banana",
     "optim.muon_adjust_lr='banana' must be one of original, match_rms_adamw or null"),
    ("optim.muon_lr=0", "optim.muon_lr=0.0 must be a positive number"),
    ("optim.schedule=linear", "optim.schedule='linear' must be one of cosine, wsd"),
    ("optim.cooldown_fraction=0", "optim.cooldown_fraction=0.0 must be a number in (0, 1]"),
    ("optim.warmup_steps=-1", "optim.warmup_steps=-1 must be an integer >= 0"),
    ("optim.beta2=1", "optim.beta2=1.0 must be a number in [0, 1)"),
    ("optim.embedding_lr=0", "optim.embedding_lr=0.0 must be a positive number or null"),
    ("trainer.limit_val_batches=1.5", "trainer.limit_val_batches=1.5 must be null, a number of "
                                      "batches >= 1, or a fraction in (0, 1]"),
    ("trainer.max_steps=0", "trainer.max_steps=0 must be a positive integer"),
    ("trainer.target_val_loss=0", "trainer.target_val_loss=0.0 must be a positive number or "
                                  "null"),
    ("compile=maybe", "compile='maybe' must be one of auto, true, false"),
    ("cpu_speedups=true", "cpu_speedups=true must be one of auto, false"),
    ("logger.mode=loud", "logger.mode='loud' must be one of online, offline, disabled or null"),
    ("eval.every=-1", "eval.every=-1 must be an integer >= 0"),
    ("model.dropout=1.5", "model.dropout=1.5 must be a number in [0, 1)"),
    ("model.n_head=5", "model.n_embd=256 must be divisible by n_head=5"),
    ("trainer.stop_at_target=true", "trainer.stop_at_target=true needs trainer.target_val_loss"),
    ("optim.head_lr=0.01", "optim.head_lr=0.01 needs model.tie_head=false"),
])
def test_each_bad_value_is_one_phrase_naming_it(override, message):
    problems = train_problems(train(override))
    assert len(problems) == 1 and problems[0].startswith(message), problems


def test_several_bad_values_are_listed_together():
    problems = train_problems(train("optim.muon_momentum=-0.1", "optim.min_lr=0.1",
                                    "threads=0", "model.window=0"))
    assert [p.split("=")[0] for p in problems] == [
        "model.window", "optim.muon_momentum", "threads", "optim.min_lr"]


def test_the_shipped_configs_have_no_problem():
    for overrides in ([], ["recipe=modern"], ["model=gpt2_xl", "optim=muon"],
                      ["experiment=gpt2_owt"], ["trainer=fsdp"]):
        assert train_problems(train(*overrides)) == [], overrides


def test_gpt_config_and_the_model_schema_share_one_validation():
    with pytest.raises(ValueError, match=r"^GPTConfig: dropout=1.5 must be a number in \[0, 1\)$"):
        GPTConfig(dropout=1.5)
    schema = ModelSchema(dropout=1.5)  # built unchecked: the run checks it with the rest
    assert field_problems(schema, {"dropout": Range(0, 1, high_open=True)}) == \
        field_problems(schema, GPT_CONFIG_RULES) == ["dropout=1.5 must be a number in [0, 1)"]
    assert "model.dropout=1.5 must be a number in [0, 1)" in \
        train_problems(TrainSchema(model=schema))


def test_the_model_schema_is_gpt_config_and_its_defaults_are_gpt2():
    assert issubclass(ModelSchema, GPTConfig)
    assert ModelSchema().gpt_config(50257) == GPTConfig()  # GPT-2 small, field for field
    model_fields = {f.name for f in dataclasses.fields(ModelSchema)}
    assert model_fields - {f.name for f in dataclasses.fields(GPTConfig)} == {"name", "init_from"}
    toy = train().model
    assert isinstance(toy, ModelSchema) and (toy.name, toy.n_layer, toy.vocab_size) == \
        ("toy", 4, None)
