"""llm.c token shards (minigpt.data.shards): a shard written with the published header (by
these tests, byte by byte, not by the writer) reads back token for token; many shards are one
stream; every bad shard is one line naming the file and the fix."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from minigpt.data.config import DataError
from minigpt.data.shards import (
    ShardStream,
    bos_first,
    read_header,
    shard_paths,
    write_shard,
    write_shards,
)

EOT = 50256


def published_shard(path, tokens, magic=20240520, version=1, count=None) -> None:
    """A shard as llm.c's fineweb.py writes it: 256 little-endian int32 (magic, version, token
    count, zeros), then the tokens as little-endian uint16."""
    count = len(tokens) if count is None else count
    header = struct.pack("<256i", magic, version, count, *([0] * 253))
    path.write_bytes(header + struct.pack(f"<{len(tokens)}H", *tokens))


def test_published_shard_reads_back_token_for_token(tmp_path):
    tokens = [EOT, 15496, 995, 13, EOT, 40, 1101, 65535 % 50257, 0]
    published_shard(tmp_path / "a_000000.bin", tokens)
    stream = ShardStream.from_glob(str(tmp_path / "a_*.bin"), vocab_size=50257)
    assert len(stream) == len(tokens)
    assert stream[0:len(tokens)].tolist() == tokens
    assert stream[np.array([[1, 2], [8, 0]])].tolist() == [[15496, 995], [0, EOT]]


def test_writer_writes_the_published_bytes(tmp_path):
    tokens = np.array([EOT, 1, 2, 50000], dtype=np.int64)
    write_shard(tmp_path / "ours.bin", tokens)
    published_shard(tmp_path / "theirs.bin", tokens.tolist())
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "theirs.bin").read_bytes()


def test_many_shards_are_one_stream_across_boundaries(tmp_path):
    tokens = np.arange(1, 26, dtype=np.uint16)
    paths = write_shards(tokens, tmp_path, "fw_train", shard_tokens=7)
    assert [p.name for p in paths] == [f"fw_train_00000{i}.bin" for i in range(4)]
    stream = ShardStream.from_glob(str(tmp_path / "fw_train_*.bin"))
    assert len(stream) == 25 and stream.counts == [7, 7, 7, 4]
    rows = np.array([[5, 6, 7, 8], [20, 21, 22, 23]])
    np.testing.assert_array_equal(stream[rows], tokens[rows])
    np.testing.assert_array_equal(stream[3:19], tokens[3:19])


def test_flat_stream_becomes_bos_first():
    flat = np.array([5, 6, EOT, 7, EOT], dtype=np.uint16)  # minigpt: eot after each document
    np.testing.assert_array_equal(bos_first(flat, EOT), [EOT, 5, 6, EOT, 7])


@pytest.mark.parametrize("kwargs, extra, message", [
    ({"magic": 20240521}, b"", r"has magic number 20240521, not 20240520: not an llm.c token "
                               r"shard; re-download it or write it again"),
    ({"version": 2}, b"", r"is shard version 2, this minigpt reads version 1"),
    ({"count": 5}, b"", r"has 1030 bytes but its header counts 5 tokens \(1034 bytes\): the "
                        r"shard is truncated or damaged"),
    ({}, b"\x00", r"has 1031 bytes but its header counts 3 tokens \(1030 bytes\)"),
])
def test_bad_shard_is_one_line(tmp_path, kwargs, extra, message):
    path = tmp_path / "bad.bin"
    published_shard(path, [EOT, 1, 2], **kwargs)
    path.write_bytes(path.read_bytes() + extra)
    with pytest.raises(DataError, match=message) as error:
        read_header(path)
    assert "\n" not in str(error.value) and str(path) in str(error.value)


def test_short_file_and_ids_beyond_the_vocabulary(tmp_path):
    (tmp_path / "tiny.bin").write_bytes(b"\x00" * 10)
    with pytest.raises(DataError, match=r"has 10 bytes, fewer than a shard's 1024-byte header"):
        read_header(tmp_path / "tiny.bin")
    published_shard(tmp_path / "ids.bin", [EOT, 7, 50300, 3])
    with pytest.raises(DataError, match=r"ids.bin holds token id 50300 at token offset 2, beyond "
                                        r"the tokenizer's 50257 ids"):
        ShardStream([tmp_path / "ids.bin"], vocab_size=50257)
    with pytest.raises(DataError, match=r"no token shards match .*nothing_\*.bin"):
        shard_paths(str(tmp_path / "nothing_*.bin"))


# --- shards as a data source -----------------------------------------------------------------


def shard_config(tmp_path, **kw) -> dict:
    return {"name": "fw", "source": "shards", "train_shards": str(tmp_path / "fw_train_*.bin"),
            "val_shards": str(tmp_path / "fw_val_*.bin"), "batch_size": 3, "val_tokens": 16, **kw}


def test_datamodule_trains_on_shards_as_one_stream(tmp_path):
    from minigpt.data import TokenDataModule

    rng = np.random.default_rng(0)
    train = rng.integers(0, 50257, 50).astype(np.uint16)
    val = rng.integers(0, 50257, 30).astype(np.uint16)
    write_shards(train, tmp_path, "fw_train", shard_tokens=12)  # 5 shards
    write_shards(val, tmp_path, "fw_val")
    data = TokenDataModule(shard_config(tmp_path), context_length=8, data_root=str(tmp_path / "no"))
    data.prepare_data()  # nothing to prepare: the headers are read
    assert (data.meta["train_tokens"], data.meta["val_tokens"], data.vocab_size) == (50, 30, 50257)
    assert data.tokenizer.name == "gpt2"
    x, y = next(data.train_batches())
    assert x.shape == y.shape == (3, 8)
    for row_x, row_y in zip(x.numpy(), y.numpy(), strict=True):
        start = next(i for i in range(50 - 8) if np.array_equal(train[i:i + 8], row_x))
        np.testing.assert_array_equal(row_y, train[start + 1:start + 9])
    vx, vy = next(iter(data.val_dataloader()))
    np.testing.assert_array_equal(vx[0].numpy(), val[:8])
    np.testing.assert_array_equal(vy[0].numpy(), val[1:9])


def test_shards_are_a_source_of_the_registry_with_nothing_to_prepare(tmp_path):
    """``source=shards`` is an entry of ``SOURCES``: ``prepare_dataset`` (``python -m
    minigpt.data``) returns what the shards' headers say and writes nothing under data_root; it
    is no source of documents."""
    from minigpt.data.config import DataConfig
    from minigpt.data.prepare import prepare_dataset
    from minigpt.data.sources import SOURCES, DocumentSource, ShardsSource, source_for

    write_shards(np.arange(40, dtype=np.uint16), tmp_path, "fw_train", shard_tokens=16)
    write_shards(np.arange(20, dtype=np.uint16), tmp_path, "fw_val")
    config = DataConfig.from_any(shard_config(tmp_path))
    assert isinstance(SOURCES["shards"], ShardsSource) and source_for(config) is SOURCES["shards"]
    meta = prepare_dataset(config, tmp_path / "data", progress=False)
    assert (meta["train_tokens"], meta["val_tokens"], meta["dtype"]) == (40, 20, "uint16")
    assert not (tmp_path / "data").exists()
    stream = SOURCES["shards"].split_tokens(config, tmp_path / "data" / "fw", meta, "train")
    np.testing.assert_array_equal(stream[0:40], np.arange(40))  # across the three shards
    assert not isinstance(SOURCES["shards"], DocumentSource)  # tokens: no documents to read
    from minigpt.data.__main__ import summary  # what `python -m minigpt.data` prints for them

    line = summary("data/fw", meta)
    assert line.startswith("data/fw: 40 train + 20 val tokens (uint16, tokenizer gpt2, ")
    assert "documents" not in line and line.endswith(f"fingerprint {meta['fingerprint']})")


def test_source_shards_needs_both_globs():
    from minigpt.data.config import DataConfig

    with pytest.raises(DataError, match="source=shards needs train_shards and val_shards"):
        DataConfig(name="fw", source="shards", train_shards="a_*.bin")


def test_a_prepared_dataset_becomes_shards(tmp_path, capsys):
    from minigpt.data.prepare import prepare_dataset
    from minigpt.data.shards import main
    from minigpt.data.tokens import open_tokens

    (tmp_path / "a.txt").write_text("The first document.")
    (tmp_path / "b.txt").write_text("And a second one, longer than the first.")
    config = {"name": "two", "source": "files", "paths": [str(tmp_path / "*.txt")],
              "tokenizer": "gpt2", "val_split": "document", "val_fraction": 0.5,
              "cache_dir": str(tmp_path / "hf")}
    prepare_dataset(config, tmp_path / "data", progress=False)
    main([str(tmp_path / "data" / "two"), str(tmp_path / "shards")])
    assert "train: 1 shard(s)" in capsys.readouterr().out
    for split in ("train", "val"):
        flat = np.asarray(open_tokens(tmp_path / "data" / "two", split))
        shard = ShardStream.from_glob(str(tmp_path / "shards" / f"two_{split}_*.bin"), 50257)
        assert shard[0] == EOT and flat[-1] == EOT
        np.testing.assert_array_equal(shard[1:len(shard)], flat[:-1])


def test_an_id_beyond_the_vocabulary_is_found_when_the_run_opens_its_shards(tmp_path):
    """Training reads batches at random: an id no batch has read yet is found when the run
    opens its shards (every id checked), not when a batch happens to read it."""
    from minigpt.data import TokenDataModule

    tokens = np.random.default_rng(0).integers(0, 50257, 3000).astype(np.uint16)
    tokens[::50] = 50256
    tokens[2345] = 50300  # in the third train shard
    write_shards(tokens[:2800], tmp_path, "fw_train", shard_tokens=1000)
    write_shards(tokens[2800:], tmp_path, "fw_val")
    data = TokenDataModule(shard_config(tmp_path), context_length=8, data_root=str(tmp_path / "no"))
    with pytest.raises(DataError, match=r"fw_train_000002\.bin holds token id 50300 at token "
                                        r"offset 345, beyond the tokenizer's 50257 ids"):
        data.prepare_data()
