"""The training loop's promises that a reader cannot see in the numbers: no host sync in a
micro-batch that does not log, and a compiled loss that compiles once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch.utils._python_dispatch import TorchDispatchMode

from minigpt.train.run import run

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.context_length=32",
    "data.batch_size=4", "data.val_tokens=512", "trainer=cpu", "trainer.enable_progress_bar=true",
    "logger=csv", "optim.warmup_steps=2", "sample.max_new_tokens=4",
]


def tiny_cfg(data_root: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=[*TINY, f"data_root={data_root}", *overrides])


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    from minigpt.data import prepare_dataset

    root = tmp_path_factory.mktemp("data")
    prepare_dataset(tiny_cfg(root).data, root, progress=False)
    return root


class HostSyncs(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense`` (what ``.item()``, ``float()`` and ``bool()`` on a
    tensor run: a copy to the host, which on a GPU waits for every queued kernel), by the phase of
    the loop it happened in: ``(step, micro)`` inside a micro-batch (its optimizer step
    included), ``(step, "end")`` after step ``step`` (logging, validation, checkpoints)."""

    def __init__(self):
        super().__init__()
        self.phase = ("start", None)
        self.counts: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.counts[self.phase] = self.counts.get(self.phase, 0) + 1
        return func(*args, **(kwargs or {}))

    # Fabric callbacks: the loop calls them
    def on_train_batch_start(self, loop, micro):
        self.phase = (loop.progress.global_step + 1, micro)

    def on_train_step_end(self, loop, loss):
        self.phase = (loop.progress.global_step, "end")


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_no_host_sync_in_a_micro_batch_that_does_not_log(tmp_path, data_root, precision):
    syncs = HostSyncs()
    cfg = tiny_cfg(data_root, "trainer.max_steps=6", "trainer.log_every_n_steps=3",
                   "trainer.val_check_interval=6", "trainer.accumulate_grad_batches=2",
                   f"trainer.precision={precision}")
    with syncs:
        run(cfg, tmp_path / "run", callbacks=[syncs])
    inside = {phase: n for phase, n in syncs.counts.items() if isinstance(phase[1], int)}
    assert inside == {}, inside  # not one copy inside any micro-batch, logging or not
    ends = {phase[0] for phase in syncs.counts if phase[1] == "end"}
    assert ends <= {3, 6}, syncs.counts  # logging steps (3, 6) and the validation (6) only


def test_compiled_training_compiles_its_graph_once(tmp_path, data_root):
    """compile=true with accumulation 2 and a validation in between: one graph for training,
    one for validation (no gradients), and no recompilation when training goes on."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg = tiny_cfg(data_root, "compile=true", "trainer.max_steps=4", "trainer.val_check_interval=2",
                   "trainer.accumulate_grad_batches=2", "trainer.log_every_n_steps=1",
                   "trainer.precision=32-true", "trainer.enable_progress_bar=false")
    summary = run(cfg, tmp_path / "run")
    assert summary["steps"] == 4
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert not counters["recompiles"] or sum(counters["recompiles"].values()) <= 1, \
        dict(counters["recompiles"])
    assert not counters["graph_break"], dict(counters["graph_break"])
