"""Writing training checkpoints: the state one holds, written whole or not at all.

One state per checkpoint (its keys: ``minigpt.checkpoint.format``), written with
``fabric.save``: the model, the optimizers, the LR schedulers, the optimizer step, the data
position, each process's RNG state, the best validation loss so far, and the model config and
tokenizer, all as tensors and plain types so ``torch.load(weights_only=True)`` reads it. Under
FSDP with sharded checkpoints it is a directory with one shard per process, which resumes on any
number of processes (``minigpt.checkpoint.restore``).

Files: ``best.ckpt`` (lowest val/loss) and ``last.ckpt``; when a validation improves, ``last`` is
a link to ``best`` rather than a second copy. Each is written under a hidden temporary name and
renamed into place, so a crash never leaves half a checkpoint under a real name; a later run in
the same directory removes what a killed one left.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from lightning.fabric import Fabric

from minigpt.checkpoint.format import BEST, LAST, METADATA_KEY, checkpoint_metadata
from minigpt.train.rng import rng_state


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
