"""Writing training checkpoints (``minigpt.checkpoint.format``) with ``fabric.save``, whole or
not at all: ``best.ckpt`` and ``last.ckpt`` (a link to ``best`` when a validation improves),
each written under a hidden temporary name and renamed into place; a failed write removes its
temporary file, keeps the previous checkpoints and raises one ``CheckpointWriteError`` line.
The RNG states go in too, so a resumed run draws what the uninterrupted one would have.
"""

from __future__ import annotations

import errno
import gc
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins import TorchCheckpointIO

from minigpt.checkpoint.format import BEST, LAST, METADATA_KEY, checkpoint_metadata
from minigpt.errors import UserError
from minigpt.files import disk_full_error, out_of_space


class CheckpointWriteError(UserError, OSError):
    """A checkpoint that could not be written: the path, the bytes needed as far as known, what
    is still on disk, and the fix. Its temporary file is gone; earlier checkpoints are kept."""


class DirectCheckpointIO(TorchCheckpointIO):
    """``torch.save`` straight to the path Fabric is given (Lightning's own writer stages the
    whole file in the system temp directory, which then needs room for a checkpoint too)."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        torch.save(checkpoint, path)


def training_state(module, optimizers: dict, schedulers: dict, data, progress: dict,
                   model_config: dict, tokenizer: dict, chat_template: dict | None = None) -> dict:
    """The state ``fabric.save`` writes: ``optimizers`` by name (``optimizer``, ``muon``) and
    their schedulers' states under ``schedulers``; ``chat_template`` for a run on conversations.
    Collective (every process's RNG state is gathered)."""
    return {
        "model": module,
        **optimizers,
        "schedulers": {name: s.state_dict() for name, s in schedulers.items()},
        "data": data.state_dict(),
        **progress,  # format.PROGRESS_KEYS
        "rng_states": _gather(rng_state()),
        METADATA_KEY: checkpoint_metadata(model_config, tokenizer, chat_template),
    }


def _gather(obj) -> list:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, obj)
        return gathered
    return [obj]


def rng_state() -> dict:
    """Python's, NumPy's, torch's and (each process its own) the current CUDA device's RNG
    state, as weights_only-safe types (tensors, ints, tuples)."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (np_name, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss,
                  np_gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` returned (after a round trip through ``torch.load``)."""
    random.setstate(tuple(v if not isinstance(v, list) else tuple(v) for v in state["python"]))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state((np_name, np_keys.numpy().astype(np.uint32), np_pos, np_has_gauss,
                         np_gauss))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is None or not torch.cuda.is_available():
        return
    if isinstance(cuda, (list, tuple)):  # older checkpoints: one state per visible GPU, by index
        device = torch.cuda.current_device()
        if device >= len(cuda):
            return
        cuda = cuda[device]
    torch.cuda.set_rng_state(cuda)


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
        replaced, not followed). A failure on any process raises ``CheckpointWriteError`` on
        every process."""
        target, tmp = self.directory / name, self.directory / f".{name}.tmp"
        if self.fabric.is_global_zero:
            self.directory.mkdir(parents=True, exist_ok=True)
            _remove(tmp)
        self.fabric.barrier()
        failed, saved = None, False
        try:
            self.fabric.save(tmp, state)
            saved = True
            if self.fabric.is_global_zero:
                for file in _files(tmp):  # data on disk before the rename makes it visible
                    with open(file, "rb+") as f:
                        os.fsync(f.fileno())
                _replace(tmp, target)
        except Exception as e:
            if not isinstance(e, OSError) and not (out_of_space(e, target) or _cut_short(e)):
                raise  # a bug, not the disk: its traceback
            failed = e
        if failed is not None:
            _drop_frames(failed)
            failed = self._write_failed(target, tmp, failed)
            if not saved:  # fabric.save ends in a barrier, which the other processes are in
                self.fabric.barrier()
        # Every process learns of a failure on any of them (under DDP only rank 0 writes): all
        # stop with its line, none is left waiting in the run's next collective.
        messages = [m for m in _gather(None if failed is None else str(failed)) if m]
        if messages:
            raise failed or CheckpointWriteError(messages[0])
        return target

    def _write_failed(self, target: Path, tmp: Path, error: Exception) -> CheckpointWriteError:
        """Remove ``tmp``; the one line for ``target`` (a full disk: the bytes it needed)."""
        full = out_of_space(error, target) or _cut_short(error)  # while tmp still fills the disk
        written = sum(file.stat().st_size for file in _files(tmp))
        _remove(tmp)
        kept = [p.name for p in (self.directory / BEST, self.directory / LAST) if p.exists()]
        kept = f"{' and '.join(kept)} (the previous checkpoint) unchanged" if kept else \
            "this was the run's first checkpoint, so none is on disk: the steps so far are lost"
        if full:
            message = str(disk_full_error(target, tmp, written, kept))
        else:
            message = (f"{target}: the checkpoint could not be written "
                       f"({getattr(error, 'strerror', None) or error}): fix that or set "
                       f"hydra.run.dir to another directory and resume; {kept}")
        failed = CheckpointWriteError(message)
        failed.errno = errno.ENOSPC if full else getattr(error, "errno", None)
        return failed

    def link_last_to_best(self) -> None:
        """``last.ckpt`` becomes a link to ``best.ckpt``, which holds the same state."""
        if self.fabric.is_global_zero:
            tmp = self.directory / f".{LAST}.link.tmp"
            _remove(tmp)
            os.symlink(BEST, tmp)
            _replace(tmp, self.directory / LAST)
        self.fabric.barrier()


def _cut_short(error: BaseException) -> bool:
    """Whether ``error`` is torch's zip writer finding its file shorter than it wrote
    (``enforce fail at inline_container.cc ... unexpected pos``): a write the disk, or a quota,
    refused, which it reports without an errno."""
    return isinstance(error, RuntimeError) and "unexpected pos" in str(error)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _drop_frames(error: BaseException) -> None:
    """Free the frames of ``error`` and the errors it was raised from: torch's writer of the
    partial file lives in them, and its open file holds the disk space even once removed."""
    while error is not None:
        error.__traceback__ = None
        error = error.__cause__ or error.__context__
    gc.collect()  # frames and the writer may sit in reference cycles


def _files(path: Path) -> list[Path]:
    """``path``, or the files in a directory of shards (none where nothing is)."""
    return [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]


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
