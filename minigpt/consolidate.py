"""Sharded FSDP checkpoints -> one model-only file that ``generate.py`` reads.

A sharded checkpoint is a directory (Lightning's ``FSDPStrategy(state_dict_type="sharded")``):
``torch.distributed.checkpoint`` files with each rank's shard of the weights (``model``) and of
the optimizer state (``optimizer_0``), plus ``meta.pt`` with everything else, our ``minigpt``
metadata included. It resumes on any number of processes. Consolidating reads only the model's
tensors (in one process, no process group), never the optimizer state, and writes a checkpoint in
the format of ``minigpt.checkpoint``::

    python -m minigpt.checkpoint consolidate RUN_DIR      # -> RUN_DIR/checkpoints/model.ckpt
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

METADATA_FILE = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint
MODEL_FILE = "model.ckpt"  # the consolidated file, next to last.ckpt
MODEL_KEY = "model"  # the weights' entry in the distributed checkpoint


def is_sharded_checkpoint(path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / METADATA_FILE).is_file()


def model_file_for(path) -> Path:
    """``path``, or for a sharded checkpoint the ``model.ckpt`` beside it when that was written
    from it or later (else ``path``, whose reader then says how to consolidate)."""
    path = Path(path)
    model_file = path.parent / MODEL_FILE
    if is_sharded_checkpoint(path) and model_file.is_file() and \
            model_file.stat().st_mtime >= (path / METADATA_FILE).stat().st_mtime:
        return model_file
    return path


def read_sharded_model(path) -> dict:
    """A checkpoint dict (``state_dict`` with the model's weights, ``minigpt`` metadata,
    ``global_step``) from a sharded checkpoint directory, without the optimizer state."""
    import torch
    import torch.distributed.checkpoint as dcp

    from minigpt.checkpoint import METADATA_KEY, MODEL_PREFIX
    from minigpt.model import GPT, GPTConfig

    path = Path(path)
    meta = torch.load(path / METADATA_FILE, map_location="cpu", weights_only=True)
    config = GPTConfig.from_dict(meta[METADATA_KEY]["model_config"])
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    with torch.device("meta"):
        shapes = GPT(config).state_dict()
    # Only the keys the checkpoint holds (a tied weight may be stored once), as float32 tensors
    # of full size on the CPU: loading fills them from every rank's shard.
    weights = {MODEL_PREFIX + k: torch.empty(v.shape, dtype=v.dtype)
               for k, v in shapes.items() if f"{MODEL_KEY}.{MODEL_PREFIX}{k}" in stored}
    with warnings.catch_warnings():  # one process on purpose: torch warns that it assumes so
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single")
        dcp.load({MODEL_KEY: weights}, checkpoint_id=str(path), no_dist=True)
    return {"state_dict": weights, METADATA_KEY: meta[METADATA_KEY],
            "global_step": meta.get("global_step")}


def consolidate(source, out=None) -> Path:
    """Write the model-only file for ``source`` (a sharded checkpoint directory, or a run
    directory: its ``checkpoints/last.ckpt``); ``out`` defaults to ``model.ckpt`` beside it."""
    import torch

    from minigpt.files import atomic_write

    source = Path(source)
    if not is_sharded_checkpoint(source):
        source = source / "checkpoints" / "last.ckpt"
    if not is_sharded_checkpoint(source):
        raise FileNotFoundError(f"{source} is not a sharded checkpoint (a directory holding "
                                f"{METADATA_FILE}); full .ckpt files need no consolidating")
    out = Path(out) if out is not None else source.parent / MODEL_FILE
    checkpoint = read_sharded_model(source)
    atomic_write(out, lambda tmp: torch.save(checkpoint, tmp))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minigpt.checkpoint",
                                     description="Checkpoint tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    merge = commands.add_parser("consolidate", help="a sharded FSDP checkpoint -> model.ckpt")
    merge.add_argument("source", help="a run directory or a sharded checkpoint directory")
    merge.add_argument("--out", help=f"output file (default: {MODEL_FILE} beside the checkpoint)")
    args = parser.parse_args(argv)
    try:
        out = consolidate(args.source, args.out)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}; sample with `python generate.py ckpt_path={out}`")
    return 0
