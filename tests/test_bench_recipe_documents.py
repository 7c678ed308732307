"""bench/recipe_documents.py scores each held-out document alone: its padded batches give the
loss of running every document by itself, and the documents are the val split's, each after
the end-of-text before it and closed by the next."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bench.recipe_documents import document_loss, held_out_documents
from minigpt.model import GPT, GPTConfig


def test_padded_batches_give_each_document_alone():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, context_length=16, n_layer=2, n_head=2, n_embd=32)).eval()
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 64, n) for n in (2, 5, 17, 9, 3, 12)]
    total, count = 0.0, 0
    for d in documents:  # one at a time, no padding: the oracle
        logits = model(torch.from_numpy(d[None, :-1]))
        total += F.cross_entropy(logits[0], torch.from_numpy(d[1:]), reduction="sum").item()
        count += len(d) - 1
    assert document_loss(model, documents, batch_tokens=40) == pytest.approx(total / count,
                                                                             rel=1e-5)


def test_held_out_documents_are_the_val_splits(tmp_path):
    from minigpt.data.prepare import prepare_dataset

    (tmp_path / "a.txt").write_text("one two three\n\nfour five\n\nsix seven eight nine ten\n\n"
                                    "eleven twelve\n\nthirteen\n")
    config = {"name": "tiny", "source": "files", "paths": [str(tmp_path / "a.txt")],
              "tokenizer": "char", "sample_by": "paragraph", "val_split": "document",
              "val_fraction": 0.5, "cache_dir": str(tmp_path / "hf")}
    meta = prepare_dataset(config, tmp_path / "data", progress=False)
    documents = held_out_documents(tmp_path / "data" / "tiny", context_length=64)
    eot = meta["eot_id"]
    assert len(documents) == meta["val_documents"]
    assert all(d[-1] == eot for d in documents)  # each closed by its end-of-text
    assert all(d[0] == eot for d in documents[1:])  # ... and after the one before it
    assert sum(len(d) - 1 for d in documents[1:]) + len(documents[0]) == meta["val_tokens"]
    short = held_out_documents(tmp_path / "data" / "tiny", context_length=3)
    assert max(len(d) for d in short) == 4  # cropped to context_length + 1
