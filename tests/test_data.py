"""Data: Shakespeare reader, sources, preparation (exact token streams, idempotence, atomicity),
bad input, the CLI, and the DataModule (windows, determinism, DDP shards, exact resume)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from minigpt.data import (
    DataConfig,
    DataError,
    TokenDataModule,
    check_vocab_fits,
    load_meta,
    open_tokens,
    prepare_dataset,
)
from minigpt.data import prepare as prep
from minigpt.data.datamodule import val_window_starts, window_starts
from minigpt.data.prepare import split_long
from minigpt.data.shakespeare import play_to_text, read_plays
from minigpt.data.tokens import dtype_for
from minigpt.tokenizer import CharTokenizer, TokenizerUnavailableError, get_tokenizer

REPO = Path(__file__).resolve().parents[1]


def gpt2_or_skip():
    try:
        return get_tokenizer("gpt2")
    except TokenizerUnavailableError as e:
        pytest.skip(f"GPT-2 BPE unavailable (set TIKTOKEN_CACHE_DIR): {e}")


def files_cfg(tmp_path, paths, **kw):
    """A small local-files config with the datasets cache kept inside tmp_path."""
    return {"name": "tiny", "source": "files", "paths": [str(p) for p in paths], "tokenizer": "char",
            "cache_dir": str(tmp_path / "hf"), **kw}


def expected_stream(docs, tok, val_fraction=0.1):
    """Independent oracle for val_split=tail: the last fraction of each document goes to val."""
    train, val = [], []
    for doc in docs:
        ids = tok.encode(doc)
        if not ids:
            continue
        n_val = int(len(ids) * val_fraction)
        train += ids[: len(ids) - n_val] + [tok.eot_id]
        val += ids[len(ids) - n_val:] + [tok.eot_id] if n_val else []
    return np.array(train), np.array(val)


def assert_no_leftovers(root: Path, name: str):
    assert not (root / name).exists(), sorted(os.listdir(root))
    assert not list(root.glob(f".tmp-{name}-*"))


@pytest.fixture(scope="module")
def plays():
    return read_plays()


@pytest.fixture(scope="module")
def char_data(tmp_path_factory):
    """shakespeare_char prepared once for the DataModule tests."""
    root = tmp_path_factory.mktemp("data")
    cfg = {"name": "shakespeare_char", "source": "shakespeare", "tokenizer": "char", "batch_size": 4,
           "val_tokens": 2048}
    meta = prepare_dataset(cfg, root, progress=False)
    return cfg, root, meta


# ---- Shakespeare reader ---------------------------------------------------------------------

def test_play_markdown_becomes_plain_text():
    md = ("# Macbeth\n\n## ACT I\n\n## SCENE I. A desert place.\n\n"
          "_Thunder and lightning. Enter three Witches_\n\n"
          "**First Witch**  \nWhen shall we three meet again  \nIn thunder, lightning, or in rain?\n\n"
          "**ALL**  \n_\\[Within]_  \nFair is foul\\--and *foul* is fair:\n\n*Exeunt,\nall*\n")
    assert play_to_text(md) == (
        "Macbeth\n\nACT I\n\nSCENE I. A desert place.\n\n"
        "Thunder and lightning. Enter three Witches\n\n"
        "First Witch:\nWhen shall we three meet again\nIn thunder, lightning, or in rain?\n\n"
        "ALL:\n[Within]\nFair is foul--and foul is fair:\n\nExeunt,\nall\n")


def test_all_plays_are_read_as_plain_text(plays):
    assert len(plays) == 38
    assert [p for p, _ in plays] == sorted(p for p, _ in plays)
    text = "".join(t for _, t in plays)
    for markup in ("**", "_", "#", "\\", "  \n"):
        assert markup not in text, markup
    macbeth = dict(plays)["tragedies/macbeth.md"]
    assert macbeth.startswith("Macbeth\n\nACT I\n")
    assert "First Witch:\nWhen shall we three meet again\nIn thunder, lightning, or in rain?" in macbeth


# ---- tokenization pieces --------------------------------------------------------------------

def test_long_documents_split_without_changing_tokens(plays):
    tok = gpt2_or_skip()
    text = dict(plays)["tragedies/hamlet.md"][:60_000] + "x.\n/y  \n  z\n\nEnd"
    pieces = split_long(text, max_chars=2_000)
    assert len(pieces) > 20 and "".join(pieces) == text
    assert np.concatenate(tok.encode_batch(pieces, num_threads=2)).tolist() == tok.encode(text)


def test_dtype_choice():
    assert dtype_for(50257) == np.uint16 and dtype_for(65536) == np.uint16
    assert dtype_for(65537) == np.uint32 and dtype_for(100277) == np.uint32


# ---- preparation: exact streams, idempotence, re-preparation ----------------------------------

def test_shakespeare_char_stream_is_exact_and_reused(char_data, plays):
    cfg, root, meta = char_data
    tok = CharTokenizer.from_text(t for _, t in plays)
    train, val = expected_stream([t for _, t in plays], tok)
    assert meta["tokenizer"] == tok.to_dict() and meta["dtype"] == "uint16"
    assert (meta["train_tokens"], meta["val_tokens"], meta["documents"]) == (len(train), len(val), 38)
    np.testing.assert_array_equal(open_tokens(root / "shakespeare_char", "train"), train)
    np.testing.assert_array_equal(open_tokens(root / "shakespeare_char", "val"), val)
    # nanoGPT's layout: a headerless native-endian uint16 stream
    raw = np.fromfile(root / "shakespeare_char" / "train.bin", dtype=np.uint16)
    np.testing.assert_array_equal(raw, train)

    mtime = (root / "shakespeare_char" / "train.bin").stat().st_mtime_ns
    start = time.perf_counter()
    again = prepare_dataset(cfg, root, progress=False)
    assert time.perf_counter() - start < 0.5
    assert again == meta and (root / "shakespeare_char" / "train.bin").stat().st_mtime_ns == mtime


def test_shakespeare_gpt2_matches_a_plain_tiktoken_loop(tmp_path, plays):
    tok = gpt2_or_skip()
    meta = prepare_dataset({"name": "sh", "source": "shakespeare", "tokenizer": "gpt2"}, tmp_path,
                           progress=False)
    train, val = expected_stream([t for _, t in plays], tok)
    assert meta["vocab_size"] == 50257 and meta["dtype"] == "uint16"
    np.testing.assert_array_equal(open_tokens(tmp_path / "sh", "train"), train)
    np.testing.assert_array_equal(open_tokens(tmp_path / "sh", "val"), val)
    assert meta["max_token_id"] == max(train.max(), val.max())


def test_changed_settings_or_sources_prepare_again(tmp_path):
    (tmp_path / "a.txt").write_text("abcdefghij" * 20)
    cfg = files_cfg(tmp_path, [tmp_path / "a.txt"])
    first = prepare_dataset(cfg, tmp_path / "data", progress=False)
    assert prepare_dataset(cfg, tmp_path / "data", progress=False)["fingerprint"] == first["fingerprint"]
    second = prepare_dataset({**cfg, "val_fraction": 0.2}, tmp_path / "data", progress=False)
    assert second["fingerprint"] != first["fingerprint"] and second["val_tokens"] == 40 + 1
    (tmp_path / "a.txt").write_text("klmnopqrst" * 20)
    third = prepare_dataset({**cfg, "val_fraction": 0.2}, tmp_path / "data", progress=False)
    assert third["fingerprint"] != second["fingerprint"]
    assert CharTokenizer.from_text("klmnopqrst").to_dict() == third["tokenizer"]
    # settings that do not change the tokens (batching, workers) reuse the files
    fourth = prepare_dataset({**cfg, "val_fraction": 0.2, "batch_size": 7, "num_workers": 3},
                             tmp_path / "data", progress=False)
    assert fourth == third


def test_runtime_settings_do_not_change_tokens(tmp_path):
    docs = [f"document number {i} " * (i + 1) for i in range(30)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    base = files_cfg(tmp_path, [tmp_path / "d.jsonl"], val_split="document", val_fraction=0.2)
    a = prepare_dataset({**base, "name": "a"}, tmp_path / "data", progress=False)
    b = prepare_dataset({**base, "name": "b", "num_proc": 2}, tmp_path / "data", progress=False)
    assert b["fingerprint"] == a["fingerprint"]  # num_proc is not a [prepare] setting
    for split in ("train", "val"):
        np.testing.assert_array_equal(open_tokens(tmp_path / "data" / "a", split),
                                      open_tokens(tmp_path / "data" / "b", split))
    golden = (5 ** 0.5 - 1) / 2
    n_val = sum(((i + 1) * golden) % 1 < 0.2 for i in range(30))
    assert (a["val_documents"], a["train_documents"]) == (n_val, 30 - n_val)
    assert 4 <= n_val <= 8


# ---- sources --------------------------------------------------------------------------------

def test_text_files_by_glob_one_document_per_file_or_line(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "1.txt").write_text("first file\nline two\n")
    (tmp_path / "corpus" / "2.txt").write_text("second file\n")
    per_file = prepare_dataset(files_cfg(tmp_path, [tmp_path / "corpus" / "*.txt"]),
                               tmp_path / "data", progress=False)
    tok = CharTokenizer(per_file["tokenizer"]["chars"])
    train, _ = expected_stream(["first file\nline two\n", "second file\n"], tok)
    assert per_file["documents"] == 2
    np.testing.assert_array_equal(open_tokens(tmp_path / "data" / "tiny", "train"), train)

    per_line = prepare_dataset(files_cfg(tmp_path, [tmp_path / "corpus" / "*.txt"], name="lines",
                                         sample_by="line", val_split="document", val_fraction=0.5),
                               tmp_path / "data", progress=False)
    assert per_line["documents"] == 3


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_json_and_parquet_with_a_text_field(tmp_path, fmt):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = ["alpha beta gamma", "delta epsilon", "zeta eta theta iota"]
    path = tmp_path / f"docs.{fmt}"
    rows = [{"id": i, "body": d} for i, d in enumerate(docs)]
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    meta = prepare_dataset(files_cfg(tmp_path, [path], text_field="body"), tmp_path / "data",
                           progress=False)
    tok = CharTokenizer(meta["tokenizer"]["chars"])
    train, val = expected_stream(docs, tok)
    np.testing.assert_array_equal(open_tokens(tmp_path / "data" / "tiny", "train"), train)
    np.testing.assert_array_equal(open_tokens(tmp_path / "data" / "tiny", "val"), val)


@pytest.mark.parametrize("streaming", [False, True])
def test_hub_path_through_load_dataset_with_caps(tmp_path, streaming):
    """The hub source's own code path, on a local jsonl file (datasets.load_dataset("json", ...))."""
    docs = [f"doc {i}: " + "word " * 10 for i in range(50)]
    (tmp_path / "hub.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = {"name": "hub", "source": "hub", "hub_name": "json", "data_files": str(tmp_path / "hub.jsonl"),
           "streaming": streaming, "tokenizer": "char", "max_documents": 20,
           "cache_dir": str(tmp_path / "hf")}
    meta = prepare_dataset(cfg, tmp_path / "data", progress=False)
    assert meta["documents"] == 20
    tok = CharTokenizer(meta["tokenizer"]["chars"])
    train, _ = expected_stream(docs[:20], tok)
    np.testing.assert_array_equal(open_tokens(tmp_path / "data" / "hub", "train"), train)

    # a token cap stops after the document that reaches it
    per_doc = len(docs[0]) + 2  # characters + an eot in each split
    capped = prepare_dataset({**cfg, "name": "capped", "max_tokens": 5 * per_doc - 3}, tmp_path / "data",
                             progress=False)
    assert capped["documents"] == 5
    assert capped["train_tokens"] + capped["val_tokens"] == 5 * per_doc


# ---- bad input: one line, naming the value and the fix; nothing half-written -------------------

def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


def test_missing_file_and_empty_glob(tmp_path):
    root = tmp_path / "data"
    with pytest.raises(FileNotFoundError, match=r"data.paths\[0\]=.*nope.txt does not exist") as e:
        prepare_dataset(files_cfg(tmp_path, [tmp_path / "nope.txt"]), root, progress=False)
    one_line(e)
    with pytest.raises(FileNotFoundError, match=r"=.*/\*\.jsonl matches no files") as e:
        prepare_dataset(files_cfg(tmp_path, [tmp_path / "*.jsonl"]), root, progress=False)
    one_line(e)
    assert not root.exists() or not list(root.iterdir())


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    root = tmp_path / "data"
    for tokenizer in ("char", "gpt2"):
        if tokenizer == "gpt2":
            gpt2_or_skip()
        with pytest.raises(DataError, match="corpus is empty") as e:
            prepare_dataset(files_cfg(tmp_path, [tmp_path / "empty.txt"], tokenizer=tokenizer), root,
                            progress=False)
        one_line(e)
        assert_no_leftovers(root, "tiny")


def test_json_without_the_text_field(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"title": "a", "body": "text here"}\n')
    root = tmp_path / "data"
    with pytest.raises(DataError, match=r"no field 'text' \(fields: title, body\); set data.text_field") as e:
        prepare_dataset(files_cfg(tmp_path, [tmp_path / "d.jsonl"]), root, progress=False)
    one_line(e)
    assert_no_leftovers(root, "tiny")


def test_text_field_that_is_not_text(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": [1, 2]}\n')
    with pytest.raises(DataError, match="holds list values, not text") as e:
        prepare_dataset(files_cfg(tmp_path, [tmp_path / "d.jsonl"]), tmp_path / "data", progress=False)
    one_line(e)
    assert_no_leftovers(tmp_path / "data", "tiny")


def test_corpus_shorter_than_one_window(tmp_path):
    (tmp_path / "short.txt").write_text("tiny corpus")  # 11 chars: 10 + eot train, 1 + eot val
    cfg = files_cfg(tmp_path, [tmp_path / "short.txt"])
    prepare_dataset(cfg, tmp_path / "data", progress=False)
    dm = TokenDataModule(cfg, context_length=64, data_root=tmp_path / "data")
    with pytest.raises(DataError, match=r"has 11 tokens, fewer than one window of context_length \+ "
                                        r"1 = 65") as e:
        dm.setup("fit")
    one_line(e)


def test_vocabulary_must_fit_the_model(char_data):
    _, _, meta = char_data
    check_vocab_fits(meta, meta["vocab_size"])
    check_vocab_fits(meta, 128)
    with pytest.raises(ValueError, match=f"ids up to {meta['vocab_size'] - 1} .*vocab_size=50; set "
                                         f"model.vocab_size >= {meta['vocab_size']}") as e:
        check_vocab_fits(meta, 50)
    one_line(e)


def test_truncated_bin_is_detected_and_prepare_repairs_it(tmp_path):
    (tmp_path / "a.txt").write_text("some text to prepare " * 10)
    cfg = files_cfg(tmp_path, [tmp_path / "a.txt"])
    meta = prepare_dataset(cfg, tmp_path / "data", progress=False)
    directory = tmp_path / "data" / "tiny"
    with open(directory / "train.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(DataError, match="train.bin has 10 bytes but meta.json records .* truncated") as e:
        load_meta(directory)
    one_line(e)
    with pytest.raises(DataError, match="truncated"):
        TokenDataModule(cfg, context_length=8, data_root=tmp_path / "data").setup("fit")
    assert prepare_dataset(cfg, tmp_path / "data", progress=False) == {**meta, "seconds": pytest.approx(
        meta["seconds"], abs=10)}
    assert load_meta(directory)["train_tokens"] == meta["train_tokens"]


def test_a_damaged_middle_of_a_bin_is_found_with_its_offset(tmp_path):
    from minigpt.data.tokens import find_bad_token

    (tmp_path / "a.txt").write_text("some text to prepare " * 10)
    meta = prepare_dataset(files_cfg(tmp_path, [tmp_path / "a.txt"]), tmp_path / "data",
                           progress=False)
    directory = tmp_path / "data" / "tiny"
    tokens = np.fromfile(directory / "train.bin", dtype=meta["dtype"])
    tokens[100] = meta["vocab_size"] + 7  # far from both ends of a short file too
    tokens.tofile(directory / "train.bin")
    with pytest.raises(DataError, match=f"train.bin holds token id {meta['vocab_size'] + 7} at "
                                        "token offset 100 .* damaged") as e:
        load_meta(directory)
    one_line(e)
    # In small chunks, and a file longer than the limit: only its ends, saying what it skipped.
    assert find_bad_token(tokens, meta["vocab_size"], chunk=16) == ((100, meta["vocab_size"] + 7), 0)
    assert find_bad_token(tokens, meta["vocab_size"], limit=64, chunk=16) == \
        (None, len(tokens) - 64)
    tokens[len(tokens) - 3] = 60000
    assert find_bad_token(tokens, meta["vocab_size"], limit=64, chunk=16)[0] == \
        (len(tokens) - 3, 60000)


def test_check_token_ids_names_the_file_and_the_offset(tmp_path):
    from minigpt.data import check_token_ids

    batch = np.arange(12, dtype=np.uint16).reshape(3, 4)
    check_token_ids(batch, 12, tmp_path / "d" / "train.bin", [0, 500, 9000])
    batch[1, 2] = 40
    with pytest.raises(DataError, match=r"d/train.bin holds token id 40 at token offset 502, "
                                        r"outside the model's 12 ids.*delete .*/d and prepare") as e:
        check_token_ids(batch, 12, tmp_path / "d" / "train.bin", [0, 500, 9000])
    one_line(e)
    with pytest.raises(DataError, match="token id -1 at token offset 9003"):
        check_token_ids(np.array([[1, 2, 3, -1]]), 12, "train.bin", [9000])


def test_data_root_that_is_a_file_or_read_only_is_one_line(tmp_path):
    (tmp_path / "a.txt").write_text("some text to prepare " * 10)
    cfg = files_cfg(tmp_path, [tmp_path / "a.txt"])
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DataError, match=f"data_root={tmp_path / 'afile'} is a file") as e:
        prepare_dataset(cfg, tmp_path / "afile", progress=False)
    one_line(e)
    with pytest.raises(DataError, match="afile/sub cannot be made: .*afile is a file"):
        prepare_dataset(cfg, tmp_path / "afile" / "sub", progress=False)
    read_only = tmp_path / "ro"
    read_only.mkdir(mode=0o555)
    if os.access(read_only, os.W_OK):  # root ignores the mode; /proc/sys is read-only to all
        read_only = Path("/proc/sys")
        if os.access(read_only, os.W_OK):
            pytest.skip("no read-only directory to try")
    with pytest.raises(DataError, match=f"data_root={read_only} is read-only"):
        prepare_dataset(cfg, read_only, progress=False)


def test_text_in_another_encoding_names_the_option_and_the_conversion(tmp_path):
    (tmp_path / "a.txt").write_bytes("café naïve façade. ".encode("latin-1") * 20)
    cfg = files_cfg(tmp_path, [tmp_path / "a.txt"])
    with pytest.raises(DataError, match=r"a.txt as text: .*a.txt:1: byte 0xe9 at column 4 is not "
                                        r"utf-8 text.*set data.encoding to theirs \(perhaps "
                                        r"latin-1 or cp1252\).*iconv") as e:
        prepare_dataset(cfg, tmp_path / "data", progress=False)
    one_line(e)
    meta = prepare_dataset({**cfg, "encoding": "latin-1"}, tmp_path / "data", progress=False)
    assert "ç" in meta["tokenizer"]["chars"]
    with pytest.raises(DataError, match="encoding='nope' must be an encoding Python knows"):
        prepare_dataset({**cfg, "encoding": "nope"}, tmp_path / "data", progress=False)


def test_datamodule_refuses_data_prepared_with_other_settings(tmp_path):
    (tmp_path / "a.txt").write_text("some text to prepare " * 10)
    cfg = files_cfg(tmp_path, [tmp_path / "a.txt"])
    prepare_dataset(cfg, tmp_path / "data", progress=False)
    dm = TokenDataModule({**cfg, "val_fraction": 0.5}, context_length=8, data_root=tmp_path / "data")
    with pytest.raises(DataError, match="prepared from other sources or settings") as e:
        dm.setup("fit")
    one_line(e)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.meta["val_tokens"] == 105 + 1


def test_missing_prepared_data_says_how_to_prepare(tmp_path):
    with pytest.raises(DataError, match="meta.json is missing.*python -m minigpt.data data=nothing"):
        load_meta(tmp_path / "nothing")


def test_bad_config_values_are_reported_together():
    with pytest.raises(DataError, match=r"val_fraction=2 must be a number in \(0, 1\); num_proc=0 must") as e:
        DataConfig(name="x", val_fraction=2, num_proc=0)
    one_line(e)
    with pytest.raises(DataError, match=r"unknown data config field\(s\) \['val_fractoin'\]"):
        DataConfig.from_any({"name": "x", "val_fractoin": 0.1})
    with pytest.raises(DataError, match="source=files needs paths"):
        DataConfig(name="x", source="files")
    with pytest.raises(DataError, match="tokenizer='bpe'"):
        DataConfig(name="x", tokenizer="bpe")


def test_empty_val_split_names_the_fix(tmp_path):
    (tmp_path / "one.txt").write_text("a single document, so no whole document is held out")
    cfg = files_cfg(tmp_path, [tmp_path / "one.txt"], val_split="document")
    with pytest.raises(DataError, match="the val split is empty .* use val_split=tail") as e:
        prepare_dataset(cfg, tmp_path / "data", progress=False)
    one_line(e)
    assert_no_leftovers(tmp_path / "data", "tiny")


# ---- atomicity --------------------------------------------------------------------------------

def test_interrupted_preparation_keeps_the_previous_dataset(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("the quick brown fox " * 20)
    cfg = files_cfg(tmp_path, [tmp_path / "a.txt"])
    root = tmp_path / "data"
    old = prepare_dataset(cfg, root, progress=False)

    def interrupted(self, column):
        raise KeyboardInterrupt

    monkeypatch.setattr(prep._SplitWriter, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset({**cfg, "val_fraction": 0.3}, root, progress=False)
    assert load_meta(root / "tiny") == old  # untouched and still complete
    assert not list(root.glob(".tmp-*"))


KILLED_SCRIPT = """
import sys, time
from minigpt.data import prepare as prep
write = prep._SplitWriter.write
def slow(self, column):
    write(self, column)
    print("WROTE", flush=True)
    time.sleep(60)
prep._SplitWriter.write = slow
prep.prepare_dataset({"name": "tiny", "source": "files", "paths": [sys.argv[1]], "tokenizer": "char",
                      "val_fraction": 0.3, "cache_dir": sys.argv[3]}, sys.argv[2], progress=False)
"""


def test_kill_minus_9_never_leaves_files_taken_as_complete(tmp_path):
    (tmp_path / "a.txt").write_text("the quick brown fox " * 20)
    cfg = files_cfg(tmp_path, [tmp_path / "a.txt"])
    root = tmp_path / "data"
    old = prepare_dataset(cfg, root, progress=False)

    proc = subprocess.Popen([sys.executable, "-c", KILLED_SCRIPT, str(tmp_path / "a.txt"), str(root),
                             str(tmp_path / "hf")], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "WROTE"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert list(root.glob(".tmp-tiny-*"))  # the killed run's scratch files ...
    assert load_meta(root / "tiny") == old  # ... are not taken for the dataset
    new = prepare_dataset({**cfg, "val_fraction": 0.3}, root, progress=False)
    assert new["fingerprint"] != old["fingerprint"] and not list(root.glob(".tmp-tiny-*"))


def test_concurrent_preparations_agree(tmp_path):
    """Two preparations at once (e.g. DDP ranks) serialise on the lock; the second reuses."""
    from concurrent.futures import ThreadPoolExecutor

    (tmp_path / "a.txt").write_text("all the world's a stage " * 50)
    cfg = files_cfg(tmp_path, [tmp_path / "a.txt"])
    with ThreadPoolExecutor(2) as pool:
        metas = list(pool.map(lambda _: prepare_dataset(cfg, tmp_path / "data", progress=False),
                              range(2)))
    assert metas[0] == metas[1] and not list((tmp_path / "data").glob(".tmp-*"))


# ---- the command line -------------------------------------------------------------------------

def run_cli(*args, cwd):
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([sys.executable, "-m", "minigpt.data", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_prepares_without_littering(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "in.txt").write_text("hello hydra " * 30)
    args = ["data=local_files", f"data.paths=[{work / 'in.txt'}]", "data.tokenizer=char",
            f"data.cache_dir={tmp_path / 'hf'}", f"data_root={tmp_path / 'data'}"]
    result = run_cli(*args, cwd=work)
    assert result.returncode == 0, result.stderr
    assert "local_files: 325 train + 37 val tokens" in result.stdout
    assert sorted(os.listdir(work)) == ["in.txt"]  # no outputs/, .hydra/ or log files
    assert load_meta(tmp_path / "data" / "local_files")["train_tokens"] == 325

    bad = run_cli("data=local_files", "data.paths=[missing.txt]", f"data_root={tmp_path / 'data'}",
                  cwd=work)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        f"error: data.paths[0]=missing.txt does not exist (cwd: {work}); check the spelling"]


def test_cli_default_is_shakespeare_char_config():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose(config_name="prepare")
        assert cfg.data.name == "shakespeare_char" and cfg.data_root == "data"
        for name in ("shakespeare", "shakespeare_char", "openwebtext", "fineweb_edu", "local_files"):
            data = compose(config_name="prepare", overrides=[f"data={name}"]).data
            assert DataConfig.from_any(data).name == name  # every shipped config validates
    for yaml in (REPO / "configs" / "data").glob("*.yaml"):
        assert yaml.read_text().startswith("# "), f"{yaml.name} needs a header comment"


# ---- DataModule -------------------------------------------------------------------------------

def take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_window_functions():
    a = window_starts(1, 0, 5, 8, 1000, 16)
    np.testing.assert_array_equal(a, window_starts(1, 0, 5, 8, 1000, 16))
    assert not np.array_equal(a, window_starts(1, 1, 5, 8, 1000, 16))
    assert not np.array_equal(a, window_starts(1, 0, 6, 8, 1000, 16))
    big = window_starts(0, 0, 0, 10_000, 100, 16)
    assert big.min() == 0 and big.max() == 100 - 16 - 1
    starts = val_window_starts(1000, 16, 160)
    assert len(starts) == 10 and starts[0] == 0 and starts[-1] == 1000 - 17
    assert np.diff(starts).min() >= 16
    assert len(val_window_starts(100, 16, 10**6)) == (100 - 1) // 16


def test_batches_are_shifted_windows_of_the_token_file(char_data):
    cfg, root, meta = char_data
    dm = TokenDataModule(cfg, context_length=16, seed=7, data_root=root)
    assert dm.vocab_size == meta["vocab_size"] and dm.tokenizer.vocab_size == meta["vocab_size"]
    dm.prepare_data()
    dm.setup("fit")
    tokens = open_tokens(root / "shakespeare_char", "train")
    for b, (x, y) in enumerate(take(dm.train_dataloader(), 3)):
        assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
        # each its own contiguous tensor: pinned whole, copied to a GPU without blocking
        assert x.is_contiguous() and y.is_contiguous()
        assert x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()
        for row, start in enumerate(window_starts(7, 0, b, 4, len(tokens), 16)):
            np.testing.assert_array_equal(x[row].numpy(), tokens[start:start + 16])
            np.testing.assert_array_equal(y[row].numpy(), tokens[start + 1:start + 17])


def test_training_stream_depends_on_seed_rank_and_not_on_workers(char_data):
    cfg, root, _ = char_data

    def first(seed=1, rank=0, workers=0, n=4):
        dm = TokenDataModule({**cfg, "num_workers": workers}, context_length=8, seed=seed, data_root=root)
        dm.rank, dm.world_size = rank, 2
        dm.setup("fit")
        return torch.stack([x for x, _ in take(dm.train_dataloader(), n)])

    base = first()
    torch.testing.assert_close(base, first())
    torch.testing.assert_close(base, first(workers=2))  # workers interleave back into order
    assert not torch.equal(base, first(seed=2))
    assert not torch.equal(base, first(rank=1))


def test_validation_windows_are_fixed_and_sharded_without_overlap(char_data):
    cfg, root, meta = char_data
    T = 16
    everything = val_window_starts(meta["val_tokens"], T, cfg["val_tokens"])
    assert len(everything) == 2048 // T

    def windows(rank, world):
        dm = TokenDataModule(cfg, context_length=T, data_root=root)
        dm.rank, dm.world_size = rank, world
        dm.setup("validate")
        loader = dm.val_dataloader()
        xs = torch.cat([x for x, _ in loader])
        assert len(loader) == -(-len(xs) // cfg["batch_size"])
        return {tuple(row.tolist()) for row in xs}, len(xs)

    single, n = windows(0, 1)
    assert n == len(everything) and single == windows(0, 1)[0]
    r0, n0 = windows(0, 3)
    r1, n1 = windows(1, 3)
    r2, n2 = windows(2, 3)
    assert n0 == n1 == n2 == len(everything) // 3
    assert not (r0 & r1) and not (r1 & r2) and not (r0 & r2)
    assert r0 | r1 | r2 <= single


def test_state_dict_round_trip_without_a_trainer(char_data):
    cfg, root, _ = char_data
    dm = TokenDataModule(cfg, context_length=8, seed=5, data_root=root)
    dm.start_batch = 17
    state = dm.state_dict()
    assert state["batches_consumed"] == 17
    other = TokenDataModule(cfg, context_length=8, seed=5, data_root=root)
    other.load_state_dict(state)
    assert other.start_batch == 17
    changed = TokenDataModule({**cfg, "batch_size": 8}, context_length=8, seed=5, data_root=root)
    with pytest.warns(UserWarning, match="batch_size: 4 -> 8"):
        changed.load_state_dict(state)
    first = next(iter(other.train_dataloader()))[0]
    tokens = open_tokens(root / "shakespeare_char", "train")
    start = window_starts(5, 0, 17, 4, len(tokens), 8)[0]
    np.testing.assert_array_equal(first[0].numpy(), tokens[start:start + 8])


def test_resume_continues_with_the_exact_batches(char_data, tmp_path):
    """A data module restored from another's state (what a checkpoint stores after 4 batches)
    hands out the batches the first one would have handed out next."""
    cfg, root, meta = char_data
    dm = TokenDataModule(cfg, context_length=8, seed=3, data_root=root)
    dm.setup()
    stream = dm.train_batches()
    straight = [next(stream)[0] for _ in range(12)]
    assert dm.batches_consumed == 12
    stream = dm.train_batches()  # again from the start: a run stopped after 2 steps of 2 each
    for _ in range(4):
        next(stream)
    state = dm.state_dict()
    assert state["batches_consumed"] == 4
    again = TokenDataModule(cfg, context_length=8, seed=3, data_root=root)
    again.setup()
    again.load_state_dict(state)
    stream = again.train_batches()
    resumed = [next(stream)[0] for _ in range(8)]
    for a, b in zip(straight[4:], resumed, strict=True):
        torch.testing.assert_close(a, b)


def test_the_config_names_every_built_in_source_and_no_other():
    # data/config.py cannot import the registry (sources.py imports the config), so its list of
    # names is a second copy: this keeps the two in step.
    from minigpt.data import config, sources

    assert set(config.SOURCES) == set(sources.SOURCES)


@pytest.mark.parametrize(("settings", "message"), [
    ({"packing": "best_fit"}, "packing=best_fit packs documents into BOS-aligned rows and does "
                              "nothing with align=window: add data.align=bos"),
    ({"train_shards": "fw_*.bin"}, "train_shards='fw_*.bin' is read only by source=shards, not "
                                   "by source=shakespeare"),
    ({"source": "hub", "hub_name": "x/y", "paths": ["a.txt"]},
     "paths=['a.txt'] is read only by source=files or chat, not by source=hub"),
    ({"source": "files", "paths": ["a.txt"], "revision": "main"},
     "revision='main' is read only by source=hub or chat, not by source=files"),
    ({"source": "files", "paths": ["a.txt"], "data_files": ["b.json"]},
     "data_files=['b.json'] is read only by source=hub, not by source=files"),
    ({"source_args": {"folder": "mail"}}, "source_args={'folder': 'mail'} is read only by "
                                          "source=chat or a dotted path"),
    ({"source": "shards", "train_shards": "a", "val_shards": "b", "tokenizer": "char"},
     "tokenizer=char does nothing with source=shards"),
])
def test_a_setting_the_combination_never_reads_is_refused(settings, message):
    with pytest.raises(DataError, match=re.escape(message)):
        DataConfig(name="x", **settings)


def test_settings_a_source_reads_are_accepted():
    DataConfig(name="x", source="chat", hub_name="a/b", hub_config="c", revision="main",
               source_args={"train_on": "all"})
    DataConfig(name="x", source="hub", hub_name="a/b", streaming=True, data_files=["f.json"])
    DataConfig(name="x", source="shards", train_shards="t_*", val_shards="v_*")
    DataConfig(name="x", align="bos", packing="best_fit")


def test_a_training_config_names_the_unread_setting_with_its_key():
    from hydra import compose, initialize_config_dir

    from minigpt.config import TrainSchema, typed
    from minigpt.config.rules import train_problems

    configs = Path(__file__).resolve().parents[1] / "configs"
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        train = typed(compose("train", overrides=["data.packing=best_fit"]), TrainSchema)
    assert any(p.startswith("data.packing=best_fit packs documents") for p in train_problems(train))
