"""Checkpoints written by earlier versions of minigpt keep loading with the same numbers."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from minigpt.checkpoint import load_checkpoint

FIXTURES = Path(__file__).parent / "fixtures"


def test_checkpoint_from_before_the_layout_split_gives_the_same_logits(checkpoint_v1):
    expected = json.loads((FIXTURES / "checkpoint_v1_logits.json").read_text())
    model, tokenizer, meta = load_checkpoint(checkpoint_v1)
    assert meta["format_version"] == 1
    assert tokenizer.encode(expected["prompt"]) == expected["ids"]
    with torch.no_grad():
        logits = model(torch.tensor([expected["ids"]]))[0]
    torch.testing.assert_close(logits, torch.tensor(expected["logits"]), rtol=0, atol=1e-5)


def test_a_checkpoint_carrying_code_is_named_as_such_and_never_runs(tmp_path):
    import pytest
    from payload import save_with_payload

    from minigpt.checkpoint import CheckpointError

    marker = tmp_path / "payload-ran"
    path = save_with_payload(tmp_path / "evil.ckpt", marker)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path)
    message = str(error.value)
    assert f"{path} holds Python objects" in message and "could run" in message
    assert "damaged" not in message and "weights_only=False" not in message
    assert not marker.exists()


def test_a_shorter_context_crops_the_position_table_and_a_longer_one_is_refused(checkpoint_v1):
    import pytest

    from minigpt.checkpoint import CheckpointError

    full, _, meta = load_checkpoint(checkpoint_v1)
    saved = meta["model_config"]["context_length"]
    short, _, _ = load_checkpoint(checkpoint_v1, context_length=saved // 2, dropout=0.1)
    assert short.config.context_length == saved // 2 and short.config.dropout == 0.1
    torch.testing.assert_close(short.pos_emb.weight, full.pos_emb.weight[:saved // 2])
    idx = torch.arange(saved // 2).unsqueeze(0) % full.config.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(short(idx), full(idx))
    with pytest.raises(CheckpointError, match=f"context_length={saved * 2} exceeds the "
                                              f"checkpoint's context_length={saved}") as error:
        load_checkpoint(checkpoint_v1, context_length=saved * 2)
    assert str(checkpoint_v1) in str(error.value) and "\n" not in str(error.value)
