"""What ``python train.py`` composes to, for benchmarks that build models by hand: the model
options a ``recipe=<name>`` sets and its optim settings, read from ``configs/`` (so they never
drift from the YAML)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL_OPTIONS = ("position", "norm", "qk_norm", "mlp", "tie_head", "zero_init_proj",
                 "logit_softcap")  # the GPTConfig fields a recipe sets


def train_config(*overrides: str):
    """The composed config of ``python train.py <overrides>``."""
    from hydra import compose, initialize_config_dir

    from minigpt.config import register_schemas

    register_schemas()  # the YAML files name their schemas
    with initialize_config_dir(str(ROOT / "configs"), version_base=None):
        return compose("train", overrides=list(overrides))


def optim_settings(*overrides: str) -> dict:
    """The optim settings (a plain dict) of ``python train.py <overrides>``."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(train_config(*overrides).optim, resolve=True)


def recipe(name: str, *overrides: str) -> tuple[dict, dict]:
    """(model options, optim settings) of ``python train.py recipe=<name> <overrides>``."""
    from omegaconf import OmegaConf

    cfg = train_config(f"recipe={name}", *overrides)
    return ({k: cfg.model[k] for k in MODEL_OPTIONS},
            OmegaConf.to_container(cfg.optim, resolve=True))
