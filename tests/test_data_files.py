"""Corpus files a user hands ``data=local_files``: globs find each file once (by identity,
symlink loops included, against ``glob.glob`` as the oracle where it terminates), and binary,
undecodable or absurdly nested content is one error naming the file and the line."""

from __future__ import annotations

import glob
import os
import time

import pytest

from minigpt.data import DataError, prepare_dataset
from minigpt.files import MAX_JSON_DEPTH
from minigpt.paths import expand_paths, glob_files


def files_cfg(paths: list[str], **more) -> dict:
    return {"name": "corpus", "source": "files", "paths": paths, "tokenizer": "char",
            "val_fraction": 0.5, "val_split": "document", **more}


@pytest.fixture
def tree(tmp_path):
    """Text files at several depths, hidden ones among them, and a non-text file."""
    for name in ("x.txt", "a/y.txt", "a/b/z.txt", "a/b/w.md", ".hidden/h.txt", ".dot.txt",
                 "c/d/e/deep.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"the text of {name}\n")
    return tmp_path


@pytest.mark.parametrize("pattern", [
    "*.txt", "**/*.txt", "**", "a/*/*.txt", ".*", "**/b/*", "*/*.txt", "a/**/*.txt", "**/*.md",
    "?.txt", "[xa]/*.txt", "**/.hidden/*", "c/**/e/*.txt", "missing/**/*.txt",
])
def test_glob_files_finds_what_glob_finds(tree, pattern, monkeypatch):
    for spelled in (str(tree / pattern), pattern):  # absolute, and relative to the cwd
        monkeypatch.chdir(tree)
        expected = sorted(p for p in glob.glob(spelled, recursive=True) if os.path.isfile(p))
        assert sorted(glob_files(spelled)) == expected


def test_a_symlink_loop_is_followed_once(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for n in range(3):
        (corpus / f"{n}.txt").write_text(f"document {n}\n")
    (corpus / "again").symlink_to(corpus)
    (corpus / "and-again").symlink_to(corpus)  # two loops: glob would walk 2**40 paths
    start = time.perf_counter()
    files = expand_paths([f"{corpus}/**/*.txt"], "data.paths")
    assert time.perf_counter() - start < 5
    assert files == [str(corpus / f"{n}.txt") for n in range(3)]
    meta = prepare_dataset(files_cfg([f"{corpus}/**/*.txt"]), tmp_path / "data", progress=False)
    assert meta["documents"] == 3


def test_each_file_is_read_once_whatever_its_spelling(tmp_path):
    (tmp_path / "a.txt").write_text("one\n")
    (tmp_path / "link.txt").symlink_to(tmp_path / "a.txt")
    os.link(tmp_path / "a.txt", tmp_path / "hard.txt")
    (tmp_path / "b.txt").write_text("two\n")
    files = expand_paths([str(tmp_path / "a.txt"), f"{tmp_path}/*.txt",
                          f"{tmp_path}/../{tmp_path.name}/b.txt"], "data.paths")
    assert files == [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]


def corpus_with(tmp_path, name: str, content: bytes) -> str:
    (tmp_path / "good.txt").write_text("plain text\n" * 5)
    (tmp_path / name).write_bytes(content)
    return f"{tmp_path}/*{os.path.splitext(name)[1]}"


@pytest.mark.parametrize("name, content, message", [
    ("img.txt", b"line one\nline two\n\x89PNG\x00\x00\x00\rIHDR", "img.txt:3: binary content"),
    ("old.txt", "one\ntwo\ncafé\n".encode("latin-1"),
     "old.txt:3: byte 0xe9 at column 4 is not utf-8 text; the files are not utf-8: set "
     "data.encoding to theirs (perhaps latin-1 or cp1252)"),
    ("deep.jsonl", b'{"text": "a"}\n{"text": "b", "x": ' + b"[" * 20_000 + b"]" * 20_000 + b"}\n",
     f"deep.jsonl:2: JSON nested more than {MAX_JSON_DEPTH} levels deep"),
])
def test_bad_corpus_content_names_the_file_and_line(tmp_path, name, content, message):
    paths = [corpus_with(tmp_path, name, content)]
    if name.endswith(".jsonl"):
        (tmp_path / "good.txt").unlink()
    with pytest.raises(DataError) as error:
        prepare_dataset(files_cfg(paths), tmp_path / "data", progress=False)
    text = str(error.value)
    assert "\n" not in text and f"{tmp_path / name.split(':')[0]}" in text and message in text
    assert not (tmp_path / "data" / "corpus" / "meta.json").exists()


def test_json_nesting_is_counted_outside_strings_and_across_lines(tmp_path):
    brackets_in_text = '{"text": "' + "[" * 5000 + '"}\n'
    (tmp_path / "a.jsonl").write_text(brackets_in_text * 2)
    meta = prepare_dataset(files_cfg([f"{tmp_path}/*.jsonl"]), tmp_path / "data", progress=False)
    assert meta["documents"] == 2
    deep = "[\n" * (MAX_JSON_DEPTH + 1) + "]\n" * (MAX_JSON_DEPTH + 1)
    (tmp_path / "b.json").write_text(deep)
    with pytest.raises(DataError, match=rf"b.json:{MAX_JSON_DEPTH + 1}: JSON nested more"):
        prepare_dataset(files_cfg([f"{tmp_path}/b.json"]), tmp_path / "data", progress=False)


def test_compressed_files_are_named_by_the_extension_before(tmp_path):
    import bz2

    (tmp_path / "a.txt.bz2").write_bytes(bz2.compress(b"compressed text\n" * 10))
    (tmp_path / "b.txt").write_text("plain text\n" * 10)
    meta = prepare_dataset(files_cfg([f"{tmp_path}/a.txt.bz2", f"{tmp_path}/b.txt"]),
                           tmp_path / "data", progress=False)
    assert meta["documents"] == 2
