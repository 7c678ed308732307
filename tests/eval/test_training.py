"""What the training loop uses: the ``eval:`` config block, its checks, the items it loads, and
``tasks_in_training`` (HellaSwag) on a tiny model (plain, bf16 autocast, through a forward-only wrapper)."""

from __future__ import annotations

import pytest
import torch
from eval_helpers import ROOT, tiny_model, write_items
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from minigpt.eval import score_items, tasks_in_training, training_items
from minigpt.tokenizer import get_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def train_config(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def test_off_for_the_toy_run_on_for_gpt2_owt(tmp_path):
    toy, owt = train_config(), train_config("experiment=gpt2_owt")
    assert toy.eval.every == 0 and training_items(toy.eval, tmp_path) is None
    assert owt.eval.every == 1 and owt.eval.limit is None


def test_items_honour_path_and_limit(tmp_path):
    write_items(tmp_path / "hs.jsonl")
    cfg = train_config("eval.every=2", "eval.limit=5", f"eval.path={tmp_path / 'hs.jsonl'}").eval
    (task, items), = training_items(cfg, tmp_path / "data")
    assert task.name == "hellaswag" and len(items) == 5
    cached = tmp_path / "data" / "eval" / "hellaswag_val.jsonl"  # path: null reads the cache
    cached.parent.mkdir(parents=True)
    write_items(cached, n=7)
    cfg = train_config("eval.every=1", "eval.limit=null").eval
    assert len(training_items(cfg, tmp_path / "data")[0][1]) == 7


class ForwardOnly(torch.nn.Module):
    """Exposes ``forward`` and ``config`` only, as a Fabric-wrapped FSDP model is safely used."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    def forward(self, idx):
        return self.inner(idx)


def test_in_training_metric(tmp_path):
    write_items(tmp_path / "hs.jsonl")
    tasks = training_items(OmegaConf.create({"every": 1, "limit": 6, "tasks": ["hellaswag"],
                                             "path": str(tmp_path / "hs.jsonl")}), tmp_path)
    model, tok = tiny_model().train(), get_tokenizer("gpt2")
    plain = tasks_in_training(model, tok, tasks, "cpu", batch_size=2)
    assert model.training and set(plain) == {"eval/hellaswag/acc", "eval/hellaswag/acc_norm"}
    expected = score_items(model.eval(), tok, tasks[0][1])
    assert plain == {"eval/hellaswag/acc": expected.acc, "eval/hellaswag/acc_norm": expected.acc_norm}
    wrapped = ForwardOnly(model).train()
    assert tasks_in_training(wrapped, tok, tasks, "cpu", batch_size=4,
                             through_forward=True) == plain and wrapped.training
    bf16 = tasks_in_training(model, tok, tasks, "cpu", batch_size=2,
                             autocast=lambda: torch.autocast("cpu", torch.bfloat16))
    assert all(0.0 <= v <= 1.0 for v in bf16.values())
