"""The typed config: every YAML names its schema and composes against it, a misspelled key (with
or without ``+``) is one line naming it and the closest valid key, and the GPT-2 presets state
only what differs from gpt2_small."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from minigpt.config import (
    ConfigKeyError,
    GenerateSchema,
    PrepareSchema,
    TrainSchema,
    check_keys,
    closest_key,
    describe_config_error,
)
from minigpt.config.schema import GROUP_SCHEMAS

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def compose_config(name: str, *overrides: str):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(name, overrides=list(overrides))


def compose_error(name: str, *overrides: str) -> BaseException:
    with pytest.raises(Exception) as error:
        compose_config(name, *overrides)
    return error.value


@pytest.mark.parametrize("group", [group for group, _ in GROUP_SCHEMAS])
def test_every_group_yaml_names_its_schema_and_composes_against_it(group):
    for path in sorted((CONFIGS / group).glob("*.yaml")):
        defaults = yaml.safe_load(path.read_text()).get("defaults", [])
        first = defaults[0] if defaults else None
        # its group's schema, or another file of the group that does (gpt2_medium: gpt2_small)
        assert first in ("schema", f"/{group}/schema@{group}") or \
            (CONFIGS / group / f"{first}.yaml").is_file(), (path, defaults)
        cfg = compose_config("train", f"{group}={path.stem}")
        check_keys(cfg, TrainSchema)


def test_the_primary_configs_compose_against_their_schemas():
    for name, schema in (("train", TrainSchema), ("generate", GenerateSchema),
                         ("prepare", PrepareSchema)):
        check_keys(compose_config(name), schema)
    cfg = compose_config("train", "experiment=gpt2_owt", "trainer=fsdp", "attention=rope_window")
    check_keys(cfg, TrainSchema)
    assert cfg.trainer.fsdp.sharding_strategy == "FULL_SHARD" and cfg.model.window == 64


def test_the_larger_gpt2_presets_state_only_what_differs_from_small():
    small = yaml.safe_load((CONFIGS / "model" / "gpt2_small.yaml").read_text())
    for size in ("medium", "large", "xl"):
        preset = yaml.safe_load((CONFIGS / "model" / f"gpt2_{size}.yaml").read_text())
        assert preset["defaults"][0] == "gpt2_small", size
        for section in ("model", "data"):
            for key, value in preset.get(section, {}).items():
                assert small.get(section, {}).get(key) != value, (size, section, key)
        cfg = compose_config("train", f"model=gpt2_{size}")
        assert cfg.model.name == f"gpt2_{size}" and cfg.model.context_length == 1024
        assert cfg.data.name == "shakespeare" and cfg.optim.lr == 6.0e-4


@pytest.mark.parametrize("override, message", [
    ("+optim.learning_rate=1e-3", "unknown config key optim.learning_rate: did you mean optim.lr?"),
    ("+seeed=3", "unknown config key seeed: did you mean seed?"),
    ("+model.block_size=64", "model.block_size: did you mean model.context_length?"),
    ("++trainer.max_step=5", "trainer.max_step: did you mean trainer.max_steps?"),
])
def test_a_key_added_with_plus_is_named_with_the_closest_valid_key(override, message):
    cfg = compose_config("train", override)  # Hydra adds it without a word
    with pytest.raises(ConfigKeyError) as error:
        check_keys(cfg, TrainSchema)
    assert str(error.value).endswith(message) and str(error.value).startswith("unknown config key")


@pytest.mark.parametrize("overrides, message", [
    (["optim.learning_rate=1e-3"], "unknown config key optim.learning_rate: did you mean optim.lr?"),
    (["data.batchsize=3"], "unknown config key data.batchsize: did you mean data.batch_size?"),
    (["trainer=fsdp", "trainer.fsdp.sharding=x"],
     "trainer.fsdp.sharding: did you mean trainer.fsdp.sharding_strategy?"),
    (["trainer.max_steps=abc"], "trainer.max_steps='abc' does not fit its type: Value 'abc'"),
    (["model.dropout=[1]"], "model.dropout="),
    (["model=nope"], "Could not find 'model/nope'; available options in 'model': gpt2_large, "
                     "gpt2_medium, gpt2_small, gpt2_xl, toy"),
    (["model.n_layer=[1"], "cannot read the override 'model.n_layer=[1'"),
])
def test_composition_errors_are_one_line(overrides, message):
    text = describe_config_error(compose_error("train", *overrides), TrainSchema)
    assert message in text and "\n" not in text and "To append" not in text


def test_closest_key_and_what_is_not_a_config_error():
    assert closest_key("trainer.val_check_intervall", TrainSchema) == "trainer.val_check_interval"
    assert closest_key("optim.max_iters", TrainSchema) == "trainer.max_steps"
    assert closest_key("zzz", TrainSchema) is None
    assert describe_config_error(ValueError("a bug"), TrainSchema) is None


def test_keys_added_on_the_command_line_are_checked_before_composing():
    from minigpt.config import added_unknown_keys

    overrides = ["+optim.learning_rate=1e-3", "++trainer.max_step=5", "optim.lr=1",
                 "+trainer.fsdp.sharding_strategy=X", "+trainer.fsdp.shard=X",
                 "+data.data_files.train=a.json", "+hydra.job.env_set.A=1", "+experiment=gpt2_owt",
                 "+seeed=1", "+model.n_layer=2"]
    assert added_unknown_keys(overrides, TrainSchema) == [
        "optim.learning_rate", "trainer.max_step", "trainer.fsdp.shard"]
