"""The Lightning ``Trainer`` from the ``trainer`` config group: precision, FSDP units,
atomic checkpoint files."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf

from minigpt.train.callbacks import AtomicCheckpointIO
from minigpt.train.config import ConfigError
from minigpt.train.device import default_precision


def build_trainer(cfg: DictConfig, run_dir: Path, callbacks: list, loggers: list) -> L.Trainer:
    t = OmegaConf.to_container(cfg.trainer, resolve=True)
    fsdp = t.pop("fsdp", None) or {}
    if t.get("precision") is None:
        t["precision"] = default_precision(t.get("accelerator", "auto"))
    if t.get("strategy") == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        from minigpt.model import Block

        # One FSDP unit per transformer block; activation checkpointing per block if asked.
        t["strategy"] = FSDPStrategy(
            auto_wrap_policy={Block},
            activation_checkpointing_policy={Block} if fsdp.get("activation_checkpointing") else None,
            sharding_strategy=fsdp.get("sharding_strategy", "FULL_SHARD"),
            state_dict_type="full",  # one .ckpt file that generate.py reads
            use_orig_params=True,
        )
    try:
        return L.Trainer(
            **t,
            default_root_dir=str(run_dir),
            callbacks=callbacks,
            logger=loggers or False,
            plugins=[AtomicCheckpointIO()],
            max_epochs=-1,  # the training stream is endless; max_steps ends the run
            check_val_every_n_epoch=None,  # val_check_interval counts batches across "epochs"
        )
    except (ValueError, TypeError, MisconfigurationException) as e:
        # Lightning's own checks (no GPU for accelerator=gpu, FSDP on a CPU, unknown argument):
        # clear messages, reported as a config error rather than a traceback.
        raise ConfigError(f"trainer: {e}") from None
