"""Checks of the composed training config, all at once, before any work starts."""

from __future__ import annotations

import os

import torch
from omegaconf import DictConfig

from minigpt.config import TrainerSchema, TrainSchema, train_problems, typed
from minigpt.errors import ConfigError

__all__ = ["ConfigError", "check_config"]  # ConfigError: its home is minigpt.errors


def check_config(cfg: TrainSchema | DictConfig) -> TrainSchema:
    """Every user-facing value that can be wrong, checked at once before training (the schema's
    rules, then what this machine can run); returns the config as a ``TrainSchema``."""
    train = typed(cfg, TrainSchema)
    problems = train_problems(train) + _machine_problems(train.trainer)
    if problems:
        raise ConfigError("bad config: " + "; ".join(problems))
    return train


def _machine_problems(t: TrainerSchema) -> list[str]:
    """Settings this machine cannot run, named with what it offers."""
    accelerator, devices = t.accelerator, t.devices
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if accelerator in ("gpu", "cuda") and not gpus:
        return [f"trainer.accelerator={accelerator} but this machine has no GPU (CUDA is not "
                "available), only the CPU; use trainer.accelerator=cpu or auto"]
    if devices in ("auto", -1, "-1", None) or isinstance(devices, str):
        return []
    count = len(devices) if isinstance(devices, list) else devices
    if not isinstance(count, int) or count < 1:
        return [f"trainer.devices={devices!r} must be a positive integer, a list of ids, or auto"]
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and gpus):
        have, what = gpus, "GPU(s)"
    else:
        have, what = os.cpu_count() or 1, "CPU core(s) (one process each)"
    if count > have:
        return [f"trainer.devices={devices} but this machine has {have} {what}"]
    return []
