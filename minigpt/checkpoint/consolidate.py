"""``python -m minigpt.checkpoint consolidate RUN_DIR``: a sharded FSDP checkpoint -> one
model-only file that ``generate.py`` reads (``RUN_DIR/checkpoints/model.ckpt``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from minigpt.checkpoint.format import (
    METADATA_FILE,
    METADATA_KEY,
    MODEL_FILE,
    MODEL_PREFIX,
    is_sharded_checkpoint,
)
from minigpt.checkpoint.read import read_checkpoint
from minigpt.errors import one_line_errors
from minigpt.files import atomic_write
from minigpt.paths import INPUT_FILE_OR_DIR, OUTPUT_FILE, PathRole, path_error, value_problems


def consolidate(source, out=None) -> Path:
    """Write the model-only file for ``source`` (a sharded checkpoint directory, or a run
    directory: its ``checkpoints/last.ckpt``); ``out`` defaults to ``model.ckpt`` beside it."""
    import torch

    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(f"{source} does not exist: give a run directory (its "
                                "checkpoints/last.ckpt) or a sharded checkpoint directory")
    if source.is_file():
        raise FileNotFoundError(f"{source} is one whole checkpoint file, not a sharded one: "
                                "it needs no consolidating (generate.py reads it as it is)")
    if not is_sharded_checkpoint(source):
        run_dir, source = source, source / "checkpoints" / "last.ckpt"
        if not (source.exists() or source.is_symlink()):
            raise FileNotFoundError(f"{run_dir} is neither a sharded checkpoint directory (no "
                                    f"{METADATA_FILE}) nor a run directory (no "
                                    "checkpoints/last.ckpt)")
    if not is_sharded_checkpoint(source):
        raise FileNotFoundError(f"{source} is not a sharded checkpoint (a directory holding "
                                f"{METADATA_FILE}); full .ckpt files need no consolidating")
    out = Path(out) if out is not None else source.parent / MODEL_FILE
    checkpoint = read_sharded_model(source)
    atomic_write(out, lambda tmp: torch.save(checkpoint, tmp))
    return out


def read_sharded_model(path) -> dict:
    """A checkpoint dict (``model``, ``minigpt`` metadata, ``global_step``) from a sharded
    checkpoint directory of either format version, without the optimizer state."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from minigpt.model import GPT, GPTConfig

    path = Path(path)
    meta = read_checkpoint(path, sharded=True)  # checked: minigpt's, a readable version
    config = GPTConfig.from_dict(meta[METADATA_KEY]["model_config"])
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    with torch.device("meta"):
        shapes = GPT(config).state_dict()
    # The keys stored (a tied weight may be stored once) as full-size CPU tensors that loading
    # fills from every rank's shard; both format versions name them "model.model.<name>".
    weights = {MODEL_PREFIX + k: torch.empty(v.shape, dtype=v.dtype)
               for k, v in shapes.items() if f"model.{MODEL_PREFIX}{k}" in stored}
    with warnings.catch_warnings():  # one process on purpose: torch warns that it assumes so
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single")
        dcp.load({"model": weights}, checkpoint_id=str(path), no_dist=True)
    return {"model": weights, METADATA_KEY: meta[METADATA_KEY],
            "global_step": meta.get("global_step")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minigpt.checkpoint",
                                     description="Checkpoint tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    merge = commands.add_parser("consolidate", help="a sharded FSDP checkpoint -> model.ckpt")
    merge.add_argument("source", help="a run directory or a sharded checkpoint directory")
    merge.add_argument("--out", help=f"output file (default: {MODEL_FILE} beside the checkpoint)")
    args = parser.parse_args(argv)
    with one_line_errors(OSError, ValueError):  # the paths first, before any checkpoint is read
        problems = value_problems("source", args.source, PathRole(INPUT_FILE_OR_DIR))
        if args.out is not None:
            problems += value_problems("--out", args.out, PathRole(OUTPUT_FILE))
        if problems:
            raise path_error(problems)
        out = consolidate(args.source, args.out)
    print(f"wrote {out}; sample with `python generate.py ckpt_path={out}`")
    return 0

