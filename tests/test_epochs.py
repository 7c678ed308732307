"""Every token once per epoch (data.sampling=epoch, minigpt.data.epochs): each row once per
epoch, processes disjoint, a seeded order, and exact resume mid-epoch on another number of
processes, through TokenDataModule's checkpoint state."""

from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import pytest

from minigpt.data import TokenDataModule
from minigpt.data.epochs import batch_positions, epoch_rows, window_rows
from minigpt.data.shards import write_shards


def test_window_rows_cover_every_token_once():
    rows = window_rows(50, 8)  # windows of 9 tokens, inputs 8 apart
    np.testing.assert_array_equal(rows, [0, 8, 16, 24, 32, 40])
    inputs = np.concatenate([np.arange(r, r + 8) for r in rows])
    assert len(set(inputs.tolist())) == len(inputs) == 48


def test_each_row_once_per_epoch_and_processes_disjoint():
    rows = np.arange(100, 123)  # 23 rows
    seen = {rank: [] for rank in range(2)}
    for b in range(23):  # 2 processes x 3 rows x 23 batches = 6 epochs
        for rank in range(2):
            seen[rank] += epoch_rows(7, rows, batch_positions(0, b, 3, rank, 2)).tolist()
    both = [row for b in range(23) for rank in range(2) for row in seen[rank][3 * b:3 * b + 3]]
    for epoch in range(6):
        assert sorted(both[23 * epoch:23 * (epoch + 1)]) == rows.tolist()
    assert both[:23] != both[23:46]  # a new order each epoch
    assert set(seen[0][:9]).isdisjoint(seen[1][:9])
    assert Counter(both) == Counter({row: 6 for row in rows.tolist()})


def data_module(tmp_path, world_size=1, rank=0) -> TokenDataModule:
    tokens = np.arange(1, 402, dtype=np.uint16)  # distinct tokens: a row names its start
    write_shards(tokens[:301], tmp_path, "t_train", shard_tokens=128)
    write_shards(tokens[301:], tmp_path, "t_val")
    config = {"name": "t", "source": "shards", "train_shards": str(tmp_path / "t_train_*"),
              "val_shards": str(tmp_path / "t_val_*"), "batch_size": 2, "val_tokens": 32,
              "sampling": "epoch"}
    return TokenDataModule(config, context_length=10, data_root=str(tmp_path / "none"),
                           rank=rank, world_size=world_size)


def starts_of(batches, n) -> list[int]:
    return [int(x[0]) - 1 for _ in range(n) for x in next(batches)[0]]


def test_datamodule_epoch_visits_every_window_and_resumes_on_other_process_counts(tmp_path):
    single = data_module(tmp_path)
    batches = single.train_batches()
    epoch = starts_of(batches, 15)  # 30 rows: one epoch
    assert sorted(epoch) == list(range(0, 300, 10))
    later = starts_of(batches, 6)
    state = single.state_dict()
    assert state["rows_read"] == 42
    expected = starts_of(batches, 4)  # the next 8 rows, as one process reads them

    ranks = [data_module(tmp_path, world_size=2, rank=r) for r in range(2)]
    streams = []
    for data in ranks:
        data.load_state_dict(state)
        streams.append(data.train_batches())
    resumed = []
    for _ in range(2):  # 2 global batches of 2 processes x 2 rows
        for stream in streams:
            resumed += starts_of(stream, 1)
    assert resumed == expected
    assert later != expected


def test_resuming_with_other_sampling_warns_and_old_checkpoints_do_not(tmp_path):
    data = data_module(tmp_path)
    state = data.state_dict()
    old = {k: v for k, v in state.items() if k not in ("align", "sampling", "rows_read")}
    window = data_module(tmp_path)
    window.config.sampling = "random"
    with pytest.warns(UserWarning, match=r"sampling: epoch -> random"):
        window.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        window.load_state_dict(old)  # written before align/sampling: random windows, silent
    assert window.rows_read == 0
