"""Train a GPT: ``python train.py [group=choice ...] [key=value ...]`` (see configs/train.yaml).

A thin Hydra entry point; the work is ``minigpt.train.run.run``."""

import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from minigpt.train.run import run_id

# outputs/<date>/${run_id:}: one directory per run, shared by all ranks (configs/train.yaml)
OmegaConf.register_new_resolver("run_id", run_id, use_cache=True)


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from minigpt.checkpoint import CheckpointError
    from minigpt.data import DataError
    from minigpt.train.config import ConfigError
    from minigpt.train.run import run

    try:
        run(cfg)
    except (ConfigError, DataError, CheckpointError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")  # one clear line, no traceback: the input was wrong


if __name__ == "__main__":
    main()
