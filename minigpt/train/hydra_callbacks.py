"""Hydra callbacks of ``train.py``, registered under ``hydra.callbacks`` in configs/train.yaml."""

from __future__ import annotations

import atexit
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from minigpt.errors import one_line_errors
from minigpt.train.run_dir import hold_run_dir


class LockRunDir(Callback):
    """Takes the run directory's writer lock (``hold_run_dir``) in ``on_run_start``, the one
    hook Hydra calls before it writes ``.hydra/*.yaml`` and ``train.log`` into the directory: a
    second process aimed at a directory in use, or at a finished run's without ``ckpt_path``,
    is refused with one line (exit status 2) and changes nothing there. The run then holds the
    same lock (``minigpt.train.run.run``); it is released when the process exits.

    A multirun's jobs (``-m``) get fresh directories; each job's run takes its own lock."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Hydra's own first step of the job, done early: interpolations such as ${hydra:job.name}
        # in hydra.run.dir need it.
        HydraConfig.instance().set_config(config)
        with one_line_errors():  # Hydra turns an exception raised here into a warning
            run_dir = Path(str(OmegaConf.select(config, "hydra.run.dir"))).resolve()
            lock = hold_run_dir(run_dir, OmegaConf.select(config, "ckpt_path"))
        atexit.register(lock.release)  # the run releases it first when it gets that far
