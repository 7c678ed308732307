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
    aligned_rows,
    best_fit_rows,
    document_starts,
    draw_rows,
    packed_row_starts,
    row_pool,
)
from minigpt.data.config import DataError
from minigpt.data.shards import write_shards
from minigpt.documents import document_ids_of

EOT = 50256


def test_document_starts_rows_and_crop_by_numbers():
    tokens = np.array([5, EOT, 1, 2, 3, EOT, 4, EOT, 6, 7, 8, 9, 10, EOT, 11, 12])
    starts = document_starts(tokens, EOT, chunk=4)  # chunks cut documents: found all the same
    np.testing.assert_array_equal(starts, [1, 5, 7, 13])  # not 0: the stream begins mid-document
    np.testing.assert_array_equal(row_pool(starts, len(tokens), 4), [1, 5, 7])
    # rows of 4 inputs: 1 (1..4), then the first start >= 5 is 5 (5..8), then >= 9: 13 does
    # not fit a row of 5 tokens
    rows = packed_row_starts(starts, len(tokens), 4)
    np.testing.assert_array_equal(rows, [1, 5])


def test_best_fit_rows_by_numbers():
    tokens = np.array([1, 2, EOT, 3, EOT, 4, 5, 6, 7, EOT, 8, EOT, 1, 1, 1, 1, 1, 1, 1, EOT])
    starts = document_starts(tokens, EOT)  # documents of 2, 5, 2, 8, 1 tokens (1, 2 skipped)
    packed = best_fit_rows(starts, len(tokens), 4)  # rows of 5 tokens
    # row 0: the 5-token document; row 1: 2 + 2 + 1; row 2: nothing fits: the shortest
    # waiting document (8 tokens) is cropped to 5
    np.testing.assert_array_equal(tokens[packed.token_index(np.arange(len(packed)))],
                                  [[EOT, 4, 5, 6, 7], [EOT, 8, EOT, 3, EOT], [EOT, 1, 1, 1, 1]])
    assert packed.used_tokens() == 15
    np.testing.assert_array_equal(packed.token_index(np.array([2, 0]))[:, 0], [11, 4])


def reference_best_fit(lengths: list[int], row: int, buffer: int) -> list[list[tuple]]:
    """nanochat's loop, written out plainly: each row takes, from the next ``buffer`` documents
    in order, the longest that fits (the later one of equal lengths); when none fits, the
    shortest (the earlier one), cropped. Rows as lists of (document, tokens taken)."""
    waiting, upcoming, rows = [], list(range(len(lengths))), []
    while True:
        room, taken = row, []
        while room:
            while len(waiting) < buffer and upcoming:
                waiting.append(upcoming.pop(0))
            if not waiting:
                return rows
            fitting = [d for d in waiting if lengths[d] <= room]
            if fitting:
                d = max(fitting, key=lambda d: (lengths[d], d))
            else:
                d = min(waiting, key=lambda d: (lengths[d], d))
            waiting.remove(d)
            taken.append((d, min(lengths[d], room)))
            room -= taken[-1][1]
        rows.append(taken)


@pytest.mark.parametrize("buffer", [3, 1000])
def test_best_fit_rows_are_nanochats_packing(buffer):
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 40, 300)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    packed = best_fit_rows(starts, int(lengths.sum()), 24, buffer=buffer)
    expected = reference_best_fit(lengths.tolist(), 25, buffer)
    assert len(packed) == len(expected)
    for r, taken in enumerate(expected):
        spans = slice(packed.row_offsets[r], packed.row_offsets[r + 1])
        np.testing.assert_array_equal(packed.span_starts[spans], [starts[d] for d, _ in taken])
        np.testing.assert_array_equal(packed.span_lengths[spans], [n for _, n in taken])
        assert packed.span_lengths[spans].sum() == 25
        # only a row's last span may be a cropped document
        whole = {int(starts[d]): int(lengths[d]) for d in range(len(lengths))}
        for start, n in zip(packed.span_starts[spans][:-1], packed.span_lengths[spans][:-1],
                            strict=True):
            assert whole[int(start)] == n


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

    shard_data(tmp_path)  # documents of 3..29 tokens as shards
    root = Path(__file__).resolve().parents[1]
    overrides = ["data=shards", f"data.train_shards={tmp_path / 'fw_train_*'}",
                 f"data.val_shards={tmp_path / 'fw_val_*'}",
                 "model.n_layer=1", "model.n_head=2", "model.n_embd=32",
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


def test_best_fit_batches_start_at_documents_resume_and_visit_each_row_once(tmp_path):
    data = shard_data(tmp_path, packing="best_fit", sampling="epoch")
    data.document_bos = EOT
    batches = data.train_batches()
    rows = len(data._packed["train"])
    seen = []
    for _ in range(-(-rows // 4)):  # one epoch of batches of 4 rows
        x, y, ids = next(batches)
        assert (x[:, 0] == EOT).all()  # shard documents begin with BOS: whole documents
        torch.testing.assert_close(ids, document_ids_of(x, EOT))
        torch.testing.assert_close(x[:, 1:], y[:, :-1])
        seen += [tuple(row) for row in x.tolist()]
    expected = data._packed["train"]
    tokens = data.split_tokens("train").open()
    every_row = {tuple(r) for r in tokens[expected.token_index(np.arange(rows))][:, :-1].tolist()}
    assert set(seen[:rows]) == every_row  # each row once in the epoch
    state = data.state_dict()
    after = next(batches)[0]
    resumed = shard_data(tmp_path, packing="best_fit", sampling="epoch")
    resumed.load_state_dict(state)
    torch.testing.assert_close(next(resumed.train_batches())[0], after)
    vx = next(iter(data.val_dataloader()))[0]
    assert (vx[:, 0] == EOT).all()


def test_a_bad_packing_is_named():
    from minigpt.data.config import DataConfig, DataError

    with pytest.raises(DataError, match=r"packing='tight' must be one of in_order, best_fit"):
        DataConfig(name="x", packing="tight")


# ---- rows that are what they claim ------------------------------------------------------------


def test_rows_start_only_at_bos_when_the_stream_begins_mid_document(tmp_path):
    """llm.c cuts shards at a fixed size: a glob from the second shard on begins inside a
    document. Its first tokens are skipped, as modded-nanogpt skips them: every row the data
    module can draw or validate on starts at a BOS."""
    shard_data(tmp_path)  # fw_train_000000..: 500 tokens each, the later ones mid-document
    later = sorted(tmp_path.glob("fw_train_*.bin"))[1:]
    tokens = np.concatenate([np.fromfile(p, dtype="<u2", offset=1024) for p in later])
    assert tokens[0] != EOT  # the oracle: the stream begins mid-document
    for packing in ("in_order", "best_fit"):
        data = TokenDataModule(
            {"name": "fw", "source": "shards", "train_shards": str(tmp_path / "fw_train_00000[1-9].bin"),
             "val_shards": str(tmp_path / "fw_val_*"), "batch_size": 4, "val_tokens": 64,
             "align": "bos", "packing": packing},
            context_length=16, data_root=str(tmp_path / "none"))
        data.setup()
        stream = data.split_tokens("train").open()
        if packing == "best_fit":
            firsts = data._packed["train"].token_index(data._train_pool)[:, 0]
        else:
            firsts = data._train_pool
        assert len(firsts) and (tokens[firsts] == EOT).all()
        assert (stream[firsts] == EOT).all()
        x = next(data.train_batches())[0]
        assert (x[:, 0] == EOT).all()


@pytest.mark.parametrize(("packing", "document_mask"), [("in_order", False), ("best_fit", True)])
def test_a_corpus_without_bos_tokens_is_refused_with_their_count(tmp_path, packing,
                                                                  document_mask):
    """200,000 tokens and no BOS: before, every row was the same first row (rc 0)."""
    tokens = np.random.default_rng(0).integers(0, EOT, 200_000).astype(np.uint16)
    write_shards(tokens[:180_000], tmp_path, "nobos_train")
    write_shards(tokens[180_000:], tmp_path, "nobos_val")
    data = TokenDataModule(
        {"name": "nobos", "source": "shards", "train_shards": str(tmp_path / "nobos_train_*"),
         "val_shards": str(tmp_path / "nobos_val_*"), "align": "bos", "packing": packing},
        context_length=64, data_root=str(tmp_path / "none"))
    data.document_bos = EOT if document_mask else None
    with pytest.raises(DataError, match=r"^data\.align=bos: the train split of nobos has "
                                        r"180,000 tokens but 0 BOS tokens \(id 50256.*use "
                                        r"data\.align=window") as refused:
        data.setup()
    assert "\n" not in str(refused.value)


def test_a_prepared_corpus_of_one_document_is_refused(tmp_path):
    """A prepared file of one long document (one end-of-text, after it): one row's worth of
    documents for thousands of rows."""
    from minigpt.data.prepare import prepare_dataset

    (tmp_path / "book.txt").write_text("".join(f"line {i} of the one long book\n"
                                               for i in range(3000)))
    config = {"name": "book", "source": "files", "paths": [str(tmp_path / "book.txt")],
              "tokenizer": "char", "val_split": "tail", "align": "bos",
              "cache_dir": str(tmp_path / "hf")}
    prepare_dataset(config, tmp_path / "data", progress=False)
    data = TokenDataModule(config, context_length=32, data_root=str(tmp_path / "data"))
    with pytest.raises(DataError, match=r"the train split of book has [\d,]+ tokens but 1 BOS "
                                        r"tokens .* would hold 0\.0% of it"):
        data.setup()


def test_enough_documents_pass_and_the_share_held_is_the_oracles():
    """Documents of 40 tokens in rows of 17: in order, a row holds 16 inputs of each document
    (the rest is cropped), 40% of the stream: above MIN_COVERAGE, so accepted."""
    tokens = np.tile(np.r_[EOT, np.arange(1, 40)], 50)
    pool, rows, packed = aligned_rows(tokens, EOT, 16, "in_order", "this stream")
    assert packed is None and len(rows) == 50 and (tokens[rows] == EOT).all()
    with pytest.raises(DataError, match=r"this stream has 2,000 tokens but 50 BOS"):
        aligned_rows(tokens, EOT, 1, "in_order", "this stream")  # 1 input a row: 2.5% held
