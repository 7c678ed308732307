"""Training checkpoints: what one holds, writing it whole or not at all, and reading it back.

One state per checkpoint, written with ``fabric.save`` and read with ``fabric.load``: the model
(its weights under ``model``, prefixed ``model.``), the optimizer, the LR scheduler, the optimizer
step, the data position, each process's RNG state, the best validation loss so far, and the
model config and tokenizer (``minigpt.checkpoint.checkpoint_metadata``), all as tensors and plain
types so ``torch.load(weights_only=True)`` reads it. Under FSDP with sharded checkpoints it is a
directory with one shard per process, which resumes on any number of processes.

Files: ``best.ckpt`` (lowest val/loss) and ``last.ckpt``; when a validation improves, ``last`` is
a link to ``best`` rather than a second copy. Each is written under a hidden temporary name and
renamed into place, so a crash never leaves half a checkpoint under a real name; a later run in
the same directory removes what a killed one left.

Checkpoints written by Lightning's Trainer (``format_version`` 1) resume too: their parts sit
under other names (``state_dict``, ``optimizer_states``, ``lr_schedulers``, ``TokenDataModule``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from lightning.fabric import Fabric

from minigpt.checkpoint import METADATA_KEY, checkpoint_metadata, is_sharded_checkpoint
from minigpt.errors import ConfigError
from minigpt.train.rng import rng_state

BEST, LAST = "best.ckpt", "last.ckpt"
OPTIMIZER_NAMES = ("optimizer", "muon")  # AdamW (alone, or for what Muon does not step), Muon


def training_state(module, optimizers: dict, schedulers: dict, data, progress: dict,
                   model_config: dict, tokenizer: dict) -> dict:
    """The state ``fabric.save`` writes: ``optimizers`` by name (``optimizer``, ``muon``) and
    their schedulers' states under ``schedulers``. Collective (every process's RNG state is
    gathered)."""
    return {
        "model": module,
        **optimizers,
        "schedulers": {name: s.state_dict() for name, s in schedulers.items()},
        "data": data.state_dict(),
        **progress,  # global_step, best_val_loss, val_loss
        "rng_states": _gather(rng_state()),
        METADATA_KEY: checkpoint_metadata(model_config, tokenizer),
    }


def _gather(obj) -> list:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, obj)
        return gathered
    return [obj]


def restore(fabric: Fabric, resume, module, optimizers: dict, schedulers: dict, data) -> dict:
    """Load the checkpoint of ``resume`` (a ``minigpt.train.resume.ResumePoint``, untyped here:
    resume.py imports this module; its header read once, before the run was built) into
    the model, optimizers, schedulers and data position; return the progress (``global_step``,
    ``best_val_loss``) and this process's RNG state (``rng``, or None for a process the
    checkpoint had none for), which the loop restores once its batches are ready."""
    path, stored = Path(resume.path), resume.optimizers
    legacy = resume.format_version == 1
    if stored is not None and stored != set(optimizers):
        raise ConfigError(f"ckpt_path={path} was trained with optimizer(s) {sorted(stored)}, this "
                          f"run has {sorted(optimizers)}: resume with the optim it was trained "
                          f"with, or start a new run from its weights with model.init_from={path}")
    if legacy and not is_sharded_checkpoint(path):
        rest = _restore_legacy_file(fabric, path, module, optimizers["optimizer"])
    elif legacy:
        rest = fabric.load(path, {"model": module, "optimizer_0": optimizers["optimizer"]},
                           strict=False, weights_only=True)
    else:
        try:
            rest = fabric.load(path, {"model": module, **optimizers}, strict=False,
                               weights_only=True)
        except ValueError as e:  # torch.optim: a group's parameter count differs
            if "parameter group" not in str(e):
                raise
            raise ConfigError(f"ckpt_path={path} holds optimizer state for other parameters than "
                              f"this run's ({e}): resume with the optim settings it was trained "
                              "with (its run directory's config.yaml; e.g. optim.muon_split_qkv, "
                              "optim.embedding_lr, optim.head_lr), or start a new run from its "
                              f"weights with model.init_from={path}") from None
    states = {"optimizer": rest["lr_schedulers"][0]} if legacy else rest["schedulers"]
    for name, scheduler in schedulers.items():
        scheduler.load_state_dict(states[name])
    data.load_state_dict(rest["TokenDataModule"] if legacy else rest["data"])
    states = rest.get("rng_states") or []
    rank = fabric.global_rank
    return {"global_step": int(rest["global_step"]), "best_val_loss": rest.get("best_val_loss"),
            "rng": states[rank] if rank < len(states) else None}


def _restore_legacy_file(fabric: Fabric, path: Path, module, optimizer) -> dict:
    """A whole-file checkpoint of Lightning's Trainer: weights under ``state_dict``, the
    optimizer state in a one-item list (which ``fabric.load`` does not look into)."""
    if any(isinstance(m, torch.distributed.fsdp.FullyShardedDataParallel) for m in module.modules()):
        raise ConfigError(f"ckpt_path={path} was written by an older minigpt as one file; resume it "
                          "without trainer=fsdp once (its next checkpoint is in today's format)")
    rest = fabric.load(path, {"state_dict": module}, strict=False, weights_only=True)
    optimizer.load_state_dict(rest["optimizer_states"][0])
    return rest


class CheckpointFiles:
    """The run's checkpoint directory, written by all processes together (each method is a
    collective), renamed into place by rank 0."""

    def __init__(self, fabric: Fabric, directory: str | Path):
        self.fabric, self.directory = fabric, Path(directory)

    def remove_leftovers(self) -> list[Path]:
        """Temporary checkpoints a killed run left behind (rank 0 removes them)."""
        leftovers = sorted(self.directory.glob(".*.tmp")) if self.directory.is_dir() else []
        if self.fabric.is_global_zero:
            for path in leftovers:
                _remove(path)
        self.fabric.barrier()
        return leftovers

    def write(self, name: str, state: dict) -> Path:
        """``fabric.save`` under a temporary name, then renamed over ``name`` (a link there is
        replaced, not followed)."""
        target, tmp = self.directory / name, self.directory / f".{name}.tmp"
        if self.fabric.is_global_zero:
            self.directory.mkdir(parents=True, exist_ok=True)
            _remove(tmp)
        self.fabric.barrier()
        self.fabric.save(tmp, state)
        if self.fabric.is_global_zero:
            _sync_to_disk(tmp)
            _replace(tmp, target)
        self.fabric.barrier()
        return target

    def link_last_to_best(self) -> None:
        """``last.ckpt`` becomes a link to ``best.ckpt``, which holds the same state."""
        if self.fabric.is_global_zero:
            tmp = self.directory / f".{LAST}.link.tmp"
            _remove(tmp)
            os.symlink(BEST, tmp)
            _replace(tmp, self.directory / LAST)
        self.fabric.barrier()


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _sync_to_disk(path: Path) -> None:
    """Data on disk before the rename makes it visible."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        with open(file, "rb+") as f:
            os.fsync(f.fileno())


def _replace(source: Path, target: Path) -> None:
    """Rename ``source`` over ``target``, whatever each is (file, directory of shards, link)."""
    if target.is_dir() and not target.is_symlink():  # a directory is not renamed over in one step
        old = target.with_name(f".{target.name}.old.tmp")
        _remove(old)
        os.replace(target, old)
        os.replace(source, target)
        shutil.rmtree(old)
    else:
        if source.is_dir() and (target.exists() or target.is_symlink()):
            target.unlink()  # a file or link: a directory is not renamed over it
        os.replace(source, target)
