"""BOS-aligned rows (data.align=bos, minigpt.data.bos): every row starts at a document's first
token, rows pack the following documents in order, random rows resume exactly, and rows carry
document_ids to a document_mask model, end to end through train.py's run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from minigpt.data import TokenDataModule
from minigpt.data.bos import (
    cropped_fraction,
    document_starts,
    draw_rows,
    packed_row_starts,
    row_pool,
)
from minigpt.data.shards import write_shards
from minigpt.documents import document_ids_of

EOT = 50256


def test_document_starts_rows_and_crop_by_numbers():
    tokens = np.array([5, EOT, 1, 2, 3, EOT, 4, EOT, 6, 7, 8, 9, 10, EOT, 11, 12])
    starts = document_starts(tokens, EOT, chunk=4)  # chunks cut documents: found all the same
    np.testing.assert_array_equal(starts, [0, 1, 5, 7, 13])
    np.testing.assert_array_equal(row_pool(starts, len(tokens), 4), [0, 1, 5, 7])
    # rows of 4 inputs: 0 (0..3), then the first start >= 4 is 5 (5..8), then >= 9: 13 does
    # not fit a row of 5 tokens
    rows = packed_row_starts(starts, len(tokens), 4)
    np.testing.assert_array_equal(rows, [0, 5])
    assert cropped_fraction(rows, len(tokens), 4) == pytest.approx(1 - 8 / 16)


def test_random_rows_are_a_pure_function_of_seed_rank_and_batch():
    pool = np.arange(0, 1000, 7)
    a = draw_rows(1, 0, 5, 8, pool)
    np.testing.assert_array_equal(a, draw_rows(1, 0, 5, 8, pool))
    assert not np.array_equal(a, draw_rows(1, 1, 5, 8, pool))
    assert set(a.tolist()) <= set(pool.tolist())


def shard_data(tmp_path: Path, **kw) -> TokenDataModule:
    rng = np.random.default_rng(0)
    parts = []
    for n in rng.integers(3, 30, 120):  # documents of 3..29 tokens, BOS first
        parts += [[EOT], rng.integers(0, EOT, n - 1).tolist()]
    tokens = np.concatenate(parts).astype(np.uint16)
    cut = np.flatnonzero(tokens == EOT)[80]  # 80 documents to train on, 40 to validate
    write_shards(tokens[:cut], tmp_path, "fw_train", shard_tokens=500)
    write_shards(tokens[cut:], tmp_path, "fw_val")
    config = {"name": "fw", "source": "shards", "train_shards": str(tmp_path / "fw_train_*"),
              "val_shards": str(tmp_path / "fw_val_*"), "batch_size": 4, "val_tokens": 64,
              "align": "bos", **kw}
    return TokenDataModule(config, context_length=16, data_root=str(tmp_path / "none"))


def test_every_row_starts_at_a_document_and_carries_its_ids(tmp_path):
    data = shard_data(tmp_path)
    data.document_bos = EOT
    batches = data.train_batches()
    for _ in range(3):
        x, y, ids = next(batches)
        assert (x[:, 0] == EOT).all()  # a BOS first: each row begins a document
        torch.testing.assert_close(ids, document_ids_of(x, EOT))
        torch.testing.assert_close(x[:, 1:], y[:, :-1])
    vx, _, _ = next(iter(data.val_dataloader()))
    assert (vx[:, 0] == EOT).all()


def test_bos_rows_resume_exactly(tmp_path):
    data = shard_data(tmp_path)
    batches = data.train_batches()
    first = [next(batches)[0] for _ in range(4)]
    state = data.state_dict()
    after = [next(batches)[0] for _ in range(2)]
    resumed = shard_data(tmp_path)
    resumed.load_state_dict(state)
    again = resumed.train_batches()
    for expected in after:
        torch.testing.assert_close(next(again)[0], expected)
    assert not torch.equal(first[0], first[1])


def test_bos_and_document_mask_train_end_to_end(tmp_path):
    from hydra import compose, initialize_config_dir

    from minigpt.train.run import run

    root = Path(__file__).resolve().parents[1]
    overrides = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32",
                 "model.context_length=32", "model.document_mask=true", "data.align=bos",
                 "data.batch_size=2", "data.val_tokens=256", "trainer=cpu",
                 "trainer.enable_progress_bar=false", "logger=csv", "optim.warmup_steps=1",
                 "sample.max_new_tokens=4", "trainer.max_steps=2", "trainer.val_check_interval=2",
                 f"data_root={tmp_path / 'data'}"]
    with initialize_config_dir(config_dir=str(root / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    seen = []  # whether each training forward of the first attention got document_ids

    class Spy:
        def on_train_batch_start(self, loop, micro):
            attention = loop.model.blocks[0].attn
            if not attention._forward_pre_hooks:
                attention.register_forward_pre_hook(
                    lambda module, args: seen.append(module.training
                                                     and isinstance(args[5], torch.Tensor)))

    summary = run(cfg, tmp_path / "run", callbacks=[Spy()])
    assert summary["steps"] == 2 and any(seen)
