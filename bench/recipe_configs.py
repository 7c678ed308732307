"""What a ``recipe=<name>`` composes to, for benchmarks that build models by hand: the model
options it sets and its optim settings, read from ``configs/`` (so they never drift from the
recipes' YAML)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL_OPTIONS = ("position", "norm", "qk_norm", "mlp", "tie_head", "zero_init_proj",
                 "logit_softcap")  # the GPTConfig fields a recipe sets


def recipe(name: str, *overrides: str) -> tuple[dict, dict]:
    """(model options, optim settings) of ``python train.py recipe=<name> <overrides>``."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from minigpt.config_schema import register_schemas

    register_schemas()  # the YAML files name their schemas
    with initialize_config_dir(str(ROOT / "configs"), version_base=None):
        cfg = compose("train", overrides=[f"recipe={name}", *overrides])
    return ({k: cfg.model[k] for k in MODEL_OPTIONS},
            OmegaConf.to_container(cfg.optim, resolve=True))
