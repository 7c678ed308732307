"""Resuming a run: ``read_resume_point`` reads the checkpoint's header once and
``check_resume_matches`` compares it with the run before it is built (one line, not a traceback
from deep inside ``fabric.load``); ``restore`` then loads it through Fabric. Version 1
(Lightning's Trainer) checkpoints resume too (``format.LEGACY_KEYS``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.fabric import Fabric

from minigpt.checkpoint.format import (
    LEGACY_KEYS,
    METADATA_KEY,
    PROGRESS_KEYS,
    is_sharded_checkpoint,
)
from minigpt.checkpoint.read import read_checkpoint
from minigpt.errors import ConfigError
from minigpt.model import GPTConfig

# Fields a resumed run may change: they do not alter the weights' shapes or meaning.
CHANGEABLE_ON_RESUME = ("dropout",)


@dataclass
class ResumePoint:
    """What a checkpoint says about the run it continues, read once: the checks before the run
    and ``restore`` both use it."""

    path: str
    step: int
    model_config: dict
    tokenizer: dict
    format_version: int
    optimizers: frozenset | None  # the optimizers' names in a whole file; None: not known
    batch: dict | None = None  # the run's batch (minigpt.train.plan.batch_record)


def read_resume_point(path: str, max_steps: int) -> ResumePoint:
    """Read ``path`` (readable, minigpt's, weights-only) and refuse to resume a run that is
    already at or past ``max_steps``."""
    checkpoint = read_checkpoint(path, sharded=True)
    step = int(checkpoint.get("global_step", 0))
    if step >= max_steps:
        raise ConfigError(f"ckpt_path={path} is at step {step}; trainer.max_steps={max_steps}: "
                          f"raise trainer.max_steps above {step} to continue")
    meta = checkpoint[METADATA_KEY]
    try:  # fields added since the checkpoint was written take their defaults, as when loading
        model_config = GPTConfig.from_dict(meta["model_config"]).to_dict()
    except ValueError as e:
        raise ConfigError(f"ckpt_path={path} records a model this minigpt cannot build: {e}") \
            from None
    version = int(meta["format_version"])
    # each optimizer has a scheduler of its name (minigpt.train.optim.checkpoint_name)
    optimizers = None if version < 2 or is_sharded_checkpoint(path) \
        else frozenset(checkpoint.get("schedulers") or ())
    return ResumePoint(str(path), step, model_config, dict(meta["tokenizer"]), version, optimizers,
                       checkpoint.get("batch"))


def check_resume_matches(resume: ResumePoint, model_config: dict, tokenizer: dict | None = None,
                         *, skip=()) -> None:
    """One line naming every model field (and the tokenizer) that differs from the checkpoint,
    and the two ways forward."""
    fields = sorted((set(model_config) | set(resume.model_config)) - {*skip, *CHANGEABLE_ON_RESUME})
    problems = [f"model.{k}={model_config.get(k)!r} here, {resume.model_config.get(k)!r} in the "
                "checkpoint" for k in fields if model_config.get(k) != resume.model_config.get(k)]
    if tokenizer is not None and tokenizer != resume.tokenizer:
        problems.append(f"the data's tokenizer is {_describe(tokenizer)} here, "
                        f"{_describe(resume.tokenizer)} in the checkpoint")
    if problems:
        raise ConfigError(
            f"ckpt_path={resume.path} does not match this run: {'; '.join(problems)}. To resume, "
            "use the settings it was trained with (drop the overrides that changed them; its run "
            "directory's config.yaml lists them); to train a new model from its weights, start a "
            f"new run with model.init_from={resume.path}")


def _describe(tokenizer: dict) -> str:
    return f"{tokenizer.get('name')!r} ({tokenizer.get('vocab_size')} ids)"


def restore(fabric: Fabric, resume: ResumePoint, module, optimizers: dict, schedulers: dict,
            data) -> dict:
    """Load ``resume``'s checkpoint into the model, optimizers, schedulers and data position;
    return the progress (the ``PROGRESS_KEYS`` it holds) and this process's RNG state (``rng``,
    None if it had none), which the loop restores once its batches are ready."""
    path, stored = Path(resume.path), resume.optimizers
    legacy = resume.format_version == 1
    if stored is not None and stored != set(optimizers):
        raise ConfigError(f"ckpt_path={path} was trained with optimizer(s) {sorted(stored)}, this "
                          f"run has {sorted(optimizers)}: resume with the optim it was trained "
                          f"with, or start a new run from its weights with model.init_from={path}")
    rest = _load_state(fabric, path, legacy, module, optimizers)
    states = {"optimizer": rest[LEGACY_KEYS["schedulers"]][0]} if legacy else rest["schedulers"]
    for name, scheduler in schedulers.items():
        scheduler.load_state_dict(states[name])
    data.load_state_dict(rest[LEGACY_KEYS["data"] if legacy else "data"])
    states = rest.get("rng_states") or []
    rank = fabric.global_rank
    return {**{k: rest[k] for k in PROGRESS_KEYS if k in rest},
            "global_step": int(rest["global_step"]),
            "rng": states[rank] if rank < len(states) else None}


def _load_state(fabric: Fabric, path: Path, legacy: bool, module, optimizers: dict) -> dict:
    """``fabric.load`` of the model and optimizers (in place); the rest of the checkpoint."""
    if legacy and not is_sharded_checkpoint(path):  # one file of Lightning's Trainer: weights
        # under state_dict, the optimizer state in a one-item list (fabric.load does not look in)
        fsdp = torch.distributed.fsdp.FullyShardedDataParallel
        if any(isinstance(m, fsdp) for m in module.modules()):
            raise ConfigError(f"ckpt_path={path} was written by an older minigpt as one file; "
                              "resume it without trainer=fsdp once (its next checkpoint is in "
                              "today's format)")
        rest = fabric.load(path, {LEGACY_KEYS["model"]: module}, strict=False, weights_only=True)
        optimizers["optimizer"].load_state_dict(rest[LEGACY_KEYS["optimizer"]][0])
        return rest
    if legacy:
        return fabric.load(path, {"model": module,
                                  LEGACY_KEYS["sharded_optimizer"]: optimizers["optimizer"]},
                           strict=False, weights_only=True)
    try:
        return fabric.load(path, {"model": module, **optimizers}, strict=False, weights_only=True)
    except ValueError as e:  # torch.optim: a group's parameter count differs
        if "parameter group" not in str(e):
            raise
        raise ConfigError(f"ckpt_path={path} holds optimizer state for other parameters than "
                          f"this run's ({e}): resume with the optim settings it was trained "
                          "with (its run directory's config.yaml; e.g. optim.muon_split_qkv, "
                          "optim.embedding_lr, optim.head_lr), or start a new run from its "
                          f"weights with model.init_from={path}") from None
