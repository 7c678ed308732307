"""The Lightning ``Trainer`` from the ``trainer`` config group: precision, FSDP units and mixed
precision, atomic checkpoint files, and the batch plan (``minigpt.train.batch``)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf

from minigpt.train.batch import BatchPlan, batch_plan, batches_between_checks
from minigpt.train.callbacks import AtomicCheckpointIO
from minigpt.train.config import ConfigError
from minigpt.train.device import default_precision, fsdp_mixed_precision


def build_trainer(cfg: DictConfig, run_dir: Path, callbacks: list, loggers: list,
                  context_length: int | None = None) -> L.Trainer:
    """The trainer, with gradient accumulation and the validation interval (given in optimizer
    steps) set from the batch plan for its world size. ``context_length``: the model's, when it
    differs from ``cfg.model`` (weights from a checkpoint fix it)."""
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
            # sharded: each rank writes its shard (resumes on any number of processes);
            # full: one .ckpt gathered into rank 0's memory
            state_dict_type="sharded" if sharded_checkpoints(cfg) else "full",
            use_orig_params=True,
            mixed_precision=fsdp_mixed_precision(t["precision"]),
        )
    try:
        trainer = L.Trainer(
            **t,
            default_root_dir=str(run_dir),
            callbacks=callbacks,
            logger=loggers or False,
            plugins=[AtomicCheckpointIO()],
            max_epochs=-1,  # the training stream is endless; max_steps ends the run
            check_val_every_n_epoch=None,  # val_check_interval counts across "epochs"
        )
    except (ValueError, TypeError, MisconfigurationException) as e:
        # Lightning's own checks (no GPU for accelerator=gpu, FSDP on a CPU, unknown argument):
        # clear messages, reported as a config error rather than a traceback.
        raise ConfigError(f"trainer: {e}") from None
    apply_batch_plan(trainer, cfg, context_length or cfg.model.context_length)
    return trainer


def apply_batch_plan(trainer: L.Trainer, cfg: DictConfig, context_length: int) -> BatchPlan:
    """Set the trainer's accumulation (derived from ``data.tokens_per_step`` for its world size)
    and its validation interval in micro-batches (``trainer.val_check_interval`` counts optimizer
    steps). After construction: only the built trainer knows its world size."""
    plan = batch_plan(cfg.data.get("tokens_per_step"), cfg.trainer.get("accumulate_grad_batches", 1),
                      cfg.data.batch_size, context_length, trainer.world_size)
    trainer.accumulate_grad_batches = plan.accumulate
    trainer.val_check_interval = batches_between_checks(cfg.trainer.get("val_check_interval"),
                                                        plan.accumulate)
    return plan


def sharded_checkpoints(cfg: DictConfig) -> bool:
    """FSDP writing a checkpoint shard per rank (``trainer.fsdp.state_dict_type``, default
    ``sharded``) rather than one ``full`` file gathered on rank 0."""
    fsdp = cfg.trainer.get("fsdp") or {}
    return cfg.trainer.get("strategy") == "fsdp" and fsdp.get("state_dict_type", "sharded") == "sharded"
