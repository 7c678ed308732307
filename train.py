"""Train a GPT: ``python train.py [group=choice ...] [key=value ...]`` (see configs/train.yaml).

A thin Hydra entry point; the work is ``minigpt.train.run.run``."""

from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from minigpt.config import TrainSchema, config_errors, register_schemas, typed
from minigpt.errors import ending_distributed_failures_at_once


def claim_run_dir(parent: str) -> str:
    """``${run_dir:outputs/<date>}``: a directory of its own for each run, shared by all ranks
    of a launch (``minigpt.train.run_dir``, imported only when Hydra resolves it)."""
    from minigpt.train.run_dir import claim_run_dir as claim

    return claim(parent)


OmegaConf.register_new_resolver("run_dir", claim_run_dir, use_cache=True)
register_schemas()  # configs/**/*.yaml name their schemas (minigpt/config/schema.py)


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from minigpt.errors import one_line_errors

    with one_line_errors():  # bad input: one line and exit status 2; bugs keep their traceback
        train = typed(cfg, TrainSchema)  # the typed config, from here on
        check_before_work(train)
        from minigpt.train.run import run  # Lightning and the rest: only for a config that runs

        run(train)


def check_before_work(train: TrainSchema) -> None:
    """The config's values and every path it names, checked before Lightning is imported or
    anything is built or read; a failure removes the run directory Hydra made for it."""
    from hydra.core.hydra_config import HydraConfig

    from minigpt.paths import check_paths
    from minigpt.train.config import check_config
    from minigpt.train.run_dir import remove_unstarted

    try:
        check_config(train)
        check_paths(train)
    except Exception:
        remove_unstarted(Path(HydraConfig.get().runtime.output_dir).resolve())
        raise


if __name__ == "__main__":
    with ending_distributed_failures_at_once():  # no gloo teardown that can hang or abort
        with config_errors(TrainSchema):  # a bad key or value while composing: one line, status 2
            main()
