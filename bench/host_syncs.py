"""Host copies (``aten._local_scalar_dense``: ``.item()``, ``float()``, ``bool()`` on a tensor) of
a short CPU ``train.py`` run, per micro-batch: the issue-19 counter, measured as a user would.

    python -m bench.host_syncs            # the tiny model, 2 micro-batches per step

Two runs in this process that differ only in length (10 and 30 steps, logging every 10, one
validation at the end): the extra copies of the longer run over its extra micro-batches are what a
training micro-batch costs, logging steps included. Only ``minigpt.train.run.run`` and config keys
that every version has are used, so the same script measures an older checkout (run it with
PYTHONPATH pointing there). On a GPU each copy waits for every kernel queued before it.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from torch.utils._python_dispatch import TorchDispatchMode

from minigpt.data import prepare_dataset
from minigpt.train.run import run

ROOT = Path(__file__).resolve().parents[1]  # the checkout: configs/, train.py

TINY = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.context_length=32",
        "data.batch_size=4", "data.val_tokens=512", "trainer=cpu", "trainer.precision=bf16-mixed",
        "trainer.enable_progress_bar=true", "trainer.log_every_n_steps=10", "logger=csv",
        "trainer.accumulate_grad_batches=2", "sample.max_new_tokens=0"]


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


def copies(steps: int, tmp: Path) -> int:
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[*TINY, f"data_root={tmp / 'data'}",
                                          f"trainer.max_steps={steps}",
                                          f"trainer.val_check_interval={steps}"])
    prepare_dataset(cfg.data, tmp / "data", progress=False)
    counter = Count()
    with counter:
        run(cfg, tmp / f"run{steps}")
    return counter.n


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        short, long = copies(10, Path(tmp)), copies(30, Path(tmp))
    micro = (30 - 10) * 2
    print(f"| run | host copies |\n|---|---|\n| 10 steps | {short} |\n| 30 steps | {long} |")
    print(f"extra copies: {long - short} over {micro} extra micro-batches (the longer run logs at 2 "
          f"more steps) = {(long - short) / micro:.2f} per micro-batch")


if __name__ == "__main__":
    main()
