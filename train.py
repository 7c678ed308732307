"""Train a GPT: ``python train.py [group=choice ...] [key=value ...]`` (see configs/train.yaml).

A thin Hydra entry point; the work is ``minigpt.train.run.run``."""

import hydra
from omegaconf import DictConfig, OmegaConf

from minigpt.config import TrainSchema, config_errors, register_schemas, typed
from minigpt.train.run_dir import claim_run_dir

# ${run_dir:outputs/<date>}: a directory of its own for each run, shared by all ranks of a launch
OmegaConf.register_new_resolver("run_dir", claim_run_dir, use_cache=True)
register_schemas()  # configs/**/*.yaml name their schemas (minigpt/config/schema.py)


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from minigpt.errors import one_line_errors
    from minigpt.train.run import run

    with one_line_errors():  # bad input: one line and exit status 2; bugs keep their traceback
        run(typed(cfg, TrainSchema))  # the typed config, from here on


if __name__ == "__main__":
    with config_errors(TrainSchema):  # a bad key or value while composing: one line, status 2
        main()
