"""minigpt.checkpoint.consolidate: a sharded checkpoint directory -> one model file, through the
real command line (``python -m minigpt.checkpoint consolidate``)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from minigpt.checkpoint import checkpoint_metadata, load_checkpoint
from minigpt.model import GPT, GPTConfig
from minigpt.tokenizer import get_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = get_tokenizer("char", text="to be or not to be")


def consolidate_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "minigpt.checkpoint", "consolidate", *args],
                          capture_output=True, text=True, env=env, timeout=120)


def write_sharded(directory: Path, model: GPT) -> None:
    """What an FSDP run writes, in one process: the weights as a distributed checkpoint (named
    ``model.model.<name>``, as the training module saves them) and ``meta.pt`` beside them."""
    import torch.distributed.checkpoint as dcp

    weights = {"model." + k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that it assumes a single process
        dcp.save({"model": weights}, checkpoint_id=str(directory), no_dist=True)
    meta = checkpoint_metadata(model.config.to_dict(), TOKENIZER.to_dict())
    torch.save({"minigpt": meta, "global_step": 4}, directory / "meta.pt")


def test_a_sharded_checkpoint_consolidates_into_the_same_weights(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, context_length=16, n_layer=2, n_head=2, n_embd=32))
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    last.mkdir(parents=True)
    write_sharded(last, model)
    result = consolidate_cli(str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    out = last.parent / "model.ckpt"
    assert f"wrote {out}" in result.stdout
    loaded, tokenizer, meta = load_checkpoint(out)
    assert loaded.config == model.config and tokenizer.to_dict() == TOKENIZER.to_dict()
    assert meta["format_version"] == 2
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)


def test_a_directory_without_shards_is_one_line_and_status_2(tmp_path):
    result = consolidate_cli(str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"error: {tmp_path} is neither a sharded checkpoint directory (no meta.pt) nor a run "
        "directory (no checkpoints/last.ckpt)"]
