"""Sharded FSDP checkpoints -> one model-only file that ``generate.py`` reads.

A sharded checkpoint (a directory, see ``minigpt.checkpoint``) resumes on any number of
processes. Consolidating reads only the model's tensors (in one process, no process group), never
the optimizer state, and writes a checkpoint in the format of ``minigpt.checkpoint``::

    python -m minigpt.checkpoint consolidate RUN_DIR      # -> RUN_DIR/checkpoints/model.ckpt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from minigpt.checkpoint import METADATA_FILE, MODEL_FILE, is_sharded_checkpoint, read_sharded_model
from minigpt.files import atomic_write


def consolidate(source, out=None) -> Path:
    """Write the model-only file for ``source`` (a sharded checkpoint directory, or a run
    directory: its ``checkpoints/last.ckpt``); ``out`` defaults to ``model.ckpt`` beside it."""
    import torch

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
