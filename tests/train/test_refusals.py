"""Refusals that come first and alone: ``None`` for a setting that takes ``null`` is told how
to write it, and a muon run on fp16 is refused before Lightning says anything about precision."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from minigpt.config import TrainSchema
from minigpt.config.reports import describe_config_error
from minigpt.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _compose(*overrides: str):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.mark.parametrize("override", ["model.logit_softcap=None", "model.window=none"])
def test_none_for_a_setting_that_takes_null_says_to_write_null(override):
    from minigpt.config import typed

    key = override.partition("=")[0]
    with pytest.raises(Exception) as error:
        typed(_compose(override), TrainSchema)
    message = describe_config_error(error.value, TrainSchema)
    assert "\n" not in message
    assert message.endswith(f"to leave it unset write {key}=null (None is a word to Hydra, not "
                            "Python's None)"), message


def test_another_bad_value_gets_no_null_hint():
    from minigpt.config import typed

    with pytest.raises(Exception) as error:
        typed(_compose("model.logit_softcap=many"), TrainSchema)
    assert "null" not in describe_config_error(error.value, TrainSchema)


def test_muon_on_fp16_is_refused_before_fabric_is_built(tmp_path, monkeypatch):
    """Fabric's constructor is where Lightning warns 'using bf16-mixed instead' on a CPU: the
    refusal must come before it is called."""
    import minigpt.train.run as run_module

    def no_fabric(*args, **kwargs):
        raise AssertionError("Fabric was built before the refusal")

    monkeypatch.setattr(run_module, "build_fabric", no_fabric)
    cfg = _compose("optim=muon", "trainer=cpu", "trainer.precision=16-mixed", "logger=none",
                   f"data_root={tmp_path}")
    with pytest.raises(ConfigError, match=r"trainer\.precision=16-mixed \(one gradient scaler "
                                          r"for two optimizers\); use bf16-mixed or 32-true"):
        run_module.run(cfg, tmp_path / "run")
