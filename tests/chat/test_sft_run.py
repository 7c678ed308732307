"""Supervised fine-tuning end to end through ``train.py``'s ``run``: a tiny model on a tiny jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from minigpt.chat.template import ChatTemplate
from minigpt.inference import load_for_inference
from minigpt.train.run import run

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.context_length=32",
        "data.batch_size=4", "trainer=cpu", "trainer.enable_progress_bar=false", "logger=csv",
        "optim.warmup_steps=2", "sample.max_new_tokens=0", "trainer.max_steps=4",
        "trainer.val_check_interval=2"]


def conversations(n: int, offset: int = 0) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"add {i} and {i + 1}"},
                          {"role": "assistant", "content": str(2 * i + 1)}]}
            for i in range(offset, offset + n)]


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("chat")
    for name, items in (("train", conversations(40)), ("val", conversations(8, offset=100))):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(c) + "\n" for c in items))
    # the book's instruction form, in the same run's data
    (root / "book.jsonl").write_text(json.dumps({"instruction": "say", "input": "hi",
                                                 "output": "hi"}) + "\n")
    return {"train": [str(root / "train.jsonl"), str(root / "book.jsonl")],
            "val": str(root / "val.jsonl")}


def chat_cfg(files: dict, *overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=[
            *TINY, "data=chat", f"data.paths=[{','.join(files['train'])}]",
            f"data.source_args.val_paths=[{files['val']}]", *overrides])


def test_sft_trains_stores_the_template_continues_and_resumes(tmp_path, chat_files):
    first = run(chat_cfg(chat_files), tmp_path / "fresh")
    assert first["steps"] == 4 and first["val_loss"] < 10
    loaded = load_for_inference(first["last"], device="cpu", dtype="float32")
    template = loaded.chat_template
    assert isinstance(template, ChatTemplate)
    assert template.end_id == loaded.tokenizer.vocab_size + 3 < loaded.model.config.vocab_size

    # experiment=sft from that checkpoint: its tokenizer and template, a shorter context
    tuned = run(chat_cfg(chat_files, "experiment=sft", f"model.init_from={first['last']}",
                         "model.context_length=24", "trainer.max_steps=2",
                         "trainer.val_check_interval=2"), tmp_path / "sft")
    assert tuned["steps"] == 2
    again = load_for_inference(tuned["last"], device="cpu", dtype="float32")
    assert again.chat_template.to_dict() == template.to_dict()

    resumed = run(chat_cfg(chat_files, f"ckpt_path={first['last']}", "trainer.max_steps=6"),
                  tmp_path / "resumed")
    assert resumed["steps"] == 6
    state = torch.load(resumed["last"], weights_only=True)
    assert state["data"]["batches_consumed"] == 6


def test_validation_loss_is_per_trained_target(tmp_path, chat_files):
    """val/loss is the cross-entropy summed over the replies' tokens of every held-out
    conversation, each run alone, divided by their count (the oracle below renders and scores
    them one by one): batches with more reply tokens weigh more, prompts and padding not at all."""
    from minigpt.model import GPT

    val = tmp_path / "val.jsonl"  # replies of 1 to 8 characters: batches of unequal target counts
    val.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"say {k}"},
        {"role": "assistant", "content": "ab"[k % 2] * k}]}) + "\n" for k in range(1, 9)))
    files = {**chat_files, "val": str(val)}
    result = run(chat_cfg(files, "trainer.precision=32-true", "data.source_args.rows=padded",
                          "trainer.max_steps=2", "trainer.val_check_interval=2"),
                 tmp_path / "run")
    loaded = load_for_inference(result["last"], device="cpu", dtype="float32")
    model, template = loaded.model, loaded.chat_template
    assert isinstance(model, GPT)
    loss_sum, targets = 0.0, 0
    with torch.no_grad():
        for line in val.read_text().splitlines():
            ids, train_mask = template.render(json.loads(line)["messages"])
            ids, trained = torch.tensor(ids), torch.tensor(train_mask[1:])
            logits = model(ids[None, :-1])[0]
            losses = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none")
            loss_sum += losses[trained].sum().item()
            targets += int(trained.sum())
    assert result["val_loss"] == pytest.approx(loss_sum / targets, rel=1e-5)


def test_missing_synthetic_set_says_how_to_write_it(tmp_path, chat_files):
    missing = tmp_path / "data" / "chat_synth" / "train.jsonl"
    with pytest.raises(FileNotFoundError, match=r"train\.jsonl does not exist.*; write the "
                       r"synthetic set with python -m minigpt\.chat\.synthetic --out"):
        run(chat_cfg({**chat_files, "train": [str(missing)]}), tmp_path / "run")
