"""Extending minigpt from a module of one's own (``tests/extending_module.py``), nothing in
``minigpt/`` edited: an optimizer class, a data source and an evaluation task, each named by its
dotted path in the config, trained, resumed, prepared and scored as the built-in ones are."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from minigpt.errors import ConfigError
from minigpt.train.run import run

ROOT = Path(__file__).resolve().parents[1]
USER = "tests.extending_module"
TINY = [
    "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.context_length=32",
    "data.batch_size=4", "data.val_tokens=256", "trainer=cpu", "trainer.max_steps=4",
    "trainer.val_check_interval=2", "trainer.enable_progress_bar=false",
    "trainer.precision=32-true", "trainer.log_every_n_steps=1", "logger=none",
    "optim.warmup_steps=1", "sample.max_new_tokens=0",
]


@pytest.fixture(autouse=True)
def importable_tests(monkeypatch):
    """``tests.extending_module`` imports as a user's module would, from the working directory."""
    monkeypatch.syspath_prepend(str(ROOT))


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """shakespeare_char prepared once (~1 s)."""
    from minigpt.data import prepare_dataset

    root = tmp_path_factory.mktemp("data")
    prepare_dataset(tiny_cfg(root).data, root, progress=False)
    return root


def tiny_cfg(data_root: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=[*TINY, f"data_root={data_root}", *overrides])


def _weights(path) -> dict:
    return torch.load(path, weights_only=True)["model"]


# ---- an optimizer ----------------------------------------------------------------------------

@pytest.mark.parametrize("role", ["optimizer", "matrix_optimizer"])
def test_a_users_optimizer_trains_and_resumes_exactly(tmp_path, data_root, role):
    """The class steps the whole model, or the blocks' matrices beside AdamW; two steps, a
    checkpoint, two more from it: the same weights as four steps straight, to the last bit."""
    mine = [f"optim.{role}={USER}.MyOptimizer", f"+optim.{role.split('_')[0]}_kwargs.momentum=0.8",
            "optim.lr=0.01", "optim.muon_lr=0.05", "optim.decay_steps=4"]  # one schedule for all
    straight = run(tiny_cfg(data_root, *mine), tmp_path / "straight")
    half = run(tiny_cfg(data_root, *mine, "trainer.max_steps=2"), tmp_path / "half")
    ckpt = torch.load(half["last"], weights_only=True)
    names = {"optimizer": {"myoptimizer"}, "matrix_optimizer": {"optimizer", "myoptimizer"}}[role]
    assert set(ckpt["schedulers"]) == names and names <= set(ckpt)
    velocities = [s["velocity"] for s in ckpt["myoptimizer"]["state"].values()]
    assert velocities and all(v.abs().sum() > 0 for v in velocities)  # its state was saved
    assert {g["momentum"] for g in ckpt["myoptimizer"]["param_groups"]} == {0.8}
    resumed = run(tiny_cfg(data_root, *mine, f"ckpt_path={half['last']}"), tmp_path / "resumed")
    want, got = _weights(straight["last"]), _weights(resumed["last"])
    assert want.keys() == got.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
    adamw = run(tiny_cfg(data_root), tmp_path / "adamw")  # the optimizer made a difference
    assert not torch.equal(_weights(adamw["last"])["model.blocks.0.mlp.fc.weight"],
                           want["model.blocks.0.mlp.fc.weight"])
    with pytest.raises(ConfigError, match=r"trained with optimizer\(s\) \[.*'myoptimizer'.*\], "
                       r"this run has \[.*\]: resume with the optim it was trained with"):
        run(tiny_cfg(data_root, "trainer.max_steps=5", f"ckpt_path={straight['last']}"),
            tmp_path / "other")


def test_the_muon_preset_is_the_same_mechanism_and_its_name_alone_is_refused(tmp_path):
    from minigpt.config import TrainSchema, train_problems, typed

    muon = typed(tiny_cfg(tmp_path, "optim=muon"), TrainSchema).optim
    assert (muon.optimizer, muon.matrix_optimizer) == ("torch.optim.AdamW", "torch.optim.Muon")
    named_only = typed(tiny_cfg(tmp_path, "optim.name=muon"), TrainSchema)
    assert train_problems(named_only) == [
        "optim.name=muon without optim.matrix_optimizer would train with AdamW alone: choose "
        "optim=muon, or set optim.matrix_optimizer=torch.optim.Muon"]


# ---- a data source ---------------------------------------------------------------------------

def test_a_users_data_source_is_prepared_cached_and_trained_on(tmp_path):
    """The function's documents become token files (the char vocabulary is theirs), reused
    while its arguments stay, prepared again when they change; a run trains on them."""
    from minigpt.data import prepare_dataset

    source = ["data.name=rhymes", f"data.source={USER}.counting_rhymes", "data.tokenizer=char",
              "+data.source_args.animal=goat"]
    cfg = tiny_cfg(tmp_path, *source).data
    meta = prepare_dataset(cfg, tmp_path, progress=False)
    rhymes = "".join(f"{i} goat jumped over the fence, and the farmer counted {i}.\n"
                     for i in range(1, 51))
    assert meta["tokenizer"]["chars"] == "".join(sorted(set(rhymes)))  # the oracle: the text
    tokens = np.concatenate([np.fromfile(tmp_path / "rhymes" / f"{split}.bin", np.uint16)
                             for split in ("train", "val")])
    text = tokens[tokens != meta["eot_id"]]  # each document's train and val parts end with eot
    assert len(text) == 3 * len(rhymes) and meta["documents"] == 50
    assert prepare_dataset(cfg, tmp_path, progress=False)["fingerprint"] == meta["fingerprint"]
    other = prepare_dataset(tiny_cfg(tmp_path, *source, "+data.source_args.count=40").data,
                            tmp_path, progress=False)
    assert other["fingerprint"] != meta["fingerprint"]
    assert other["documents"] == 40
    summary = run(tiny_cfg(tmp_path, *source, "trainer.max_steps=2", "data.val_tokens=64"),
                  tmp_path / "run")
    assert math.isfinite(summary["val_loss"])
    with pytest.raises(ValueError, match=r"^data.source='tests.nowhere.rhymes' is not a source "
                       r"\(.*\): use shakespeare, files, hub, or the dotted path"):
        prepare_dataset(tiny_cfg(tmp_path, "data.source=tests.nowhere.rhymes").data, tmp_path,
                        progress=False)


# ---- an evaluation task ----------------------------------------------------------------------

def _oracle(ckpt) -> dict:
    """The task's metrics by hand: each choice's summed log-probability from the model's full
    forward pass (no cache, no batching), the right answer first."""
    from minigpt.checkpoint import load_checkpoint
    from tests.extending_module import NextWord

    model, tokenizer, _ = load_checkpoint(ckpt)
    right, logprobs = [], []
    for context, choices, label in NextWord().items():
        sums = []
        for choice in choices:
            ids = tokenizer.encode(context + choice)
            start = len(tokenizer.encode(context))
            with torch.no_grad():
                logits = model(torch.tensor([ids[:-1]]))[0]  # (T-1, V)
            logp = torch.log_softmax(logits.double(), -1)
            sums.append(sum(float(logp[t - 1, ids[t]]) for t in range(start, len(ids))))
        right.append(max(range(len(sums)), key=sums.__getitem__) == label)
        logprobs.append(sums[label])
    return {"acc": sum(right) / len(right), "right_logprob": sum(logprobs) / len(logprobs)}


def test_a_users_eval_task_is_scored_in_training_and_from_the_command_line(tmp_path):
    import json
    import os
    import subprocess
    import sys

    task = f"{USER}.NextWord"
    summary = run(tiny_cfg(tmp_path, "data.name=rhymes", f"data.source={USER}.counting_rhymes",
                           "data.tokenizer=char", "+data.source_args.animal=goat",
                           "data.val_tokens=64", "trainer.max_steps=2", "eval.every=1",
                           f"eval.tasks=[{task}]", "eval.batch_size=3", "logger=csv"),
                  tmp_path / "run")
    oracle = _oracle(summary["last"])  # the weights of the last validation, where it was scored
    assert summary["eval/next_word/acc"] == oracle["acc"]
    assert summary["eval/next_word/right_logprob"] == pytest.approx(oracle["right_logprob"],
                                                                      abs=1e-4)
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    shown = subprocess.run([sys.executable, "-m", "minigpt.eval", f"task={task}",
                            f"ckpt_path={summary['last']}", f"out={out}", "device=cpu",
                            "dtype=float32", "progress=false"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr[-2000:]
    result = json.loads(out.read_text())
    assert (result["task"], result["n"], result["acc"]) == ("next_word", 8, oracle["acc"])
    assert result["right_logprob"] == pytest.approx(oracle["right_logprob"], abs=1e-4)
    assert shown.stdout.splitlines()[1].split()[:2] == ["next_word", "8"]
    bad = subprocess.run([sys.executable, "-m", "minigpt.eval", "task=tests.extending_module.Nope",
                          f"ckpt_path={summary['last']}"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert bad.stderr.strip().splitlines()[-1].endswith(
        "task='tests.extending_module.Nope' is not an evaluation task (AttributeError: module "
        "'tests.extending_module' has no attribute 'Nope'): use hellaswag, chat, or the dotted "
        "path of a minigpt.eval.task.Task subclass importable from the working directory")
