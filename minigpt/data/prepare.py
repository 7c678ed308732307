"""Preparation: documents -> tokens -> ``<data_root>/<name>/{train.bin, val.bin, meta.json}``
(nanoGPT's layout, ``minigpt.data.tokens``; an end-of-text token after every document).

Idempotent (same fingerprint, intact files: reused without reading the sources), atomic (written
under ``<data_root>/.tmp-<name>-*``, moved into place, ``meta.json`` last as the "complete"
marker: an interrupted or failed run leaves the previous dataset untouched), and concurrent runs
(DDP ranks, two terminals) serialise on ``<data_root>/.prepare.lock``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from minigpt.data.config import DataConfig, DataError
from minigpt.data.sources import DocumentSource, fingerprint, source_for
from minigpt.data.tokens import FORMAT_VERSION, SPLITS, dtype_for, load_meta
from minigpt.errors import first_line
from minigpt.files import atomic_write
from minigpt.paths import OUTPUT_DIR, output_problem
from minigpt.tokenizer import CharTokenizer, Tokenizer, get_tokenizer, tokenizer_from_dict

log = logging.getLogger(__name__)

MAP_BATCH_SIZE = 1000  # documents per datasets.map batch
CHUNK_CHARS = 1 << 20  # documents longer than this are encoded in pieces (threads, memory)
_GOLDEN = 0.6180339887498949
_SAFE_BREAK = re.compile(r"(?<=\S\n)(?=[^\s/])")


def split_long(text: str, max_chars: int = CHUNK_CHARS) -> list[str]:
    """Cut a long text into pieces of about ``max_chars`` that encode to the same tokens as the
    whole: after a newline with a non-space on both sides (no ``/`` after it), where every
    tiktoken pre-tokenizer regex (gpt2, cl100k, o200k) ends a piece."""
    pieces, start = [], 0
    while len(text) - start > max_chars:
        m = _SAFE_BREAK.search(text, start + max_chars)
        if m is None:
            break
        pieces.append(text[start:m.start()])
        start = m.start()
    pieces.append(text[start:])
    return pieces


def text_of(value: Any, column: str) -> str:
    """A document's text; a missing value (None) is an empty document."""
    if value is None or isinstance(value, str):
        return value or ""
    raise DataError(f"field {column!r} holds {type(value).__name__} values, not text; set "
                    f"data.text_field to the field holding the text")


class Tokenize:
    """A batch of documents -> their ``train`` and ``val`` tokens, each non-empty part ending
    with eot: ``val_split="tail"`` sends the last ``val_fraction`` of every document to val,
    ``"document"`` whole documents (chosen by index, order-independent)."""

    def __init__(self, tokenizer: dict, column: str, val_fraction: float, val_split: str,
                 dtype: str, num_threads: int = 1, transform: Callable[[str], str] | None = None):
        self.tokenizer, self.column, self.transform = tokenizer, column, transform
        self.val_fraction, self.val_split = val_fraction, val_split
        self.dtype, self.num_threads = np.dtype(dtype), num_threads
        self._tok: Tokenizer | None = None

    def __getstate__(self):  # ship the dict to datasets' worker processes, not the built tokenizer
        return {**self.__dict__, "_tok": None}

    def _encode(self, texts: list[str]) -> list[np.ndarray]:
        tok = self._tok
        if isinstance(tok, CharTokenizer) or self.transform is not None:
            # with a transform, documents are encoded whole (Shakespeare's plays are < 0.2 MB)
            return tok.encode_batch(texts, self.num_threads, transform=self.transform)
        pieces = [split_long(t) for t in texts]
        flat = iter(tok.encode_batch([p for ps in pieces for p in ps], self.num_threads))
        return [np.concatenate([next(flat) for _ in ps]) for ps in pieces]

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        if self._tok is None:
            self._tok = tokenizer_from_dict(self.tokenizer)
        ids = self._encode([text_of(t, self.column) for t in batch[self.column]])
        empty = np.empty(0, self.dtype)
        eot = np.array([self._tok.eot_id], self.dtype)
        train, val = [], []
        for index, doc in zip(indices, ids, strict=True):
            if len(doc) == 0:
                train.append(empty)
                val.append(empty)
            elif self.val_split == "document":
                part = np.concatenate([doc, eot]).astype(self.dtype)
                # a golden-ratio (Weyl) sequence: even a few documents split close to the fraction
                to_val = ((index + 1) * _GOLDEN) % 1.0 < self.val_fraction
                train.append(empty if to_val else part)
                val.append(part if to_val else empty)
            else:
                n_val = int(len(doc) * self.val_fraction)
                cut = len(doc) - n_val
                train.append(np.concatenate([doc[:cut], eot]).astype(self.dtype))
                val.append(np.concatenate([doc[cut:], eot]).astype(self.dtype) if n_val else empty)
        return {"train": train, "val": val}


def _char_tokenizer(cfg: DataConfig, ds, column: str, transform) -> CharTokenizer:
    import datasets

    if isinstance(ds, datasets.IterableDataset) and cfg.max_documents is None:
        raise DataError("the char tokenizer reads the corpus twice (vocabulary, then tokens): with "
                        "streaming=true set data.max_documents")
    seen: set[str] = set()
    for table in ds.select_columns([column]).with_format("arrow").iter(batch_size=MAP_BATCH_SIZE):
        for value in table.column(column).to_pylist():
            text = text_of(value, column)
            seen.update(transform(text) if transform else text)
    if not seen:
        raise DataError(f"data {cfg.name!r}: the corpus is empty (no characters in {_where(cfg)})")
    return CharTokenizer(sorted(seen))


def _where(cfg: DataConfig) -> str:
    return source_for(cfg).where(cfg)


@contextlib.contextmanager
def _progress_bars(enabled: bool):
    import datasets

    was = datasets.is_progress_bar_enabled()
    (datasets.enable_progress_bars if enabled else datasets.disable_progress_bars)()
    try:
        yield
    finally:
        (datasets.enable_progress_bars if was else datasets.disable_progress_bars)()


class _SplitWriter:
    """Appends token arrays to one split's temporary ``.bin`` and counts what it wrote."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path, self.dtype = path, dtype
        self.file = open(path, "wb")  # closed in close()
        self.tokens = self.documents = 0
        self.max_id = -1

    def write(self, column) -> None:  # column: a pyarrow (Chunked)Array of token lists
        for chunk in getattr(column, "chunks", [column]):
            values = chunk.flatten().to_numpy(zero_copy_only=False)
            if len(values):
                values.astype(self.dtype, copy=False).tofile(self.file)
                self.tokens += len(values)
                self.max_id = max(self.max_id, int(values.max()))
            self.documents += int((chunk.value_lengths().to_numpy(zero_copy_only=False) > 0).sum())

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


def _tokenize_and_write(cfg: DataConfig, tmp: Path, fp: str, progress: bool) -> tuple[Tokenizer, dict]:
    import datasets
    from tqdm.auto import tqdm

    source = source_for(cfg)
    if progress and source.local:
        print(f"reading {source.where(cfg)}", file=sys.stderr, flush=True)
    # datasets' bar for reading local files is left unfinished by a file that fails to load, and
    # the one-line error would land on its line; the line above says what is being read. (Hub
    # downloads keep their bars: they can take hours.)
    with _progress_bars(False) if source.local else contextlib.nullcontext():
        ds = source.load(cfg)
        streaming = isinstance(ds, datasets.IterableDataset)
        if cfg.max_documents is not None:
            ds = ds.take(cfg.max_documents) if streaming else \
                ds.select(range(min(cfg.max_documents, len(ds))))
    column, transform = source.text_column(cfg, ds), source.transform(cfg)
    if cfg.tokenizer == "char":
        tok: Tokenizer = _char_tokenizer(cfg, ds, column, transform)
    else:
        tok = get_tokenizer(cfg.tokenizer)
    dtype = dtype_for(tok.vocab_size)
    features = datasets.Features({s: datasets.Sequence(datasets.Value(dtype.name)) for s in SPLITS})
    # With a token cap (or a stream) tokenize lazily so work stops at the cap: threads, one process.
    lazy = streaming or cfg.max_tokens is not None
    num_proc = 1 if lazy else max(1, min(cfg.num_proc, len(ds)))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    fn = Tokenize(tok.to_dict(), column, cfg.val_fraction, cfg.val_split, dtype.name,
                  num_threads=max(1, (cpus or 1) // num_proc), transform=transform)
    kwargs = dict(batched=True, batch_size=MAP_BATCH_SIZE, with_indices=True,
                  remove_columns=ds.column_names, features=features)
    if lazy:
        tokenized = (ds if streaming else ds.to_iterable_dataset()).map(fn, **kwargs)
        total = cfg.max_documents if streaming else len(ds)
    else:
        tokenized = ds.map(fn, num_proc=num_proc if num_proc > 1 else None,
                           cache_file_name=str(tmp / "tokens.arrow"), load_from_cache_file=False,
                           new_fingerprint=fp, desc=f"tokenizing {cfg.name}", **kwargs)
        total = len(tokenized)

    writers = {s: _SplitWriter(tmp / f"{s}.bin", dtype) for s in SPLITS}
    documents = 0
    try:
        bar = tqdm(total=total, unit="doc", desc=f"writing {cfg.name}", disable=not progress)
        for table in tokenized.with_format("arrow").iter(batch_size=MAP_BATCH_SIZE):
            table = table.select(list(SPLITS))
            if cfg.max_tokens is not None:  # keep documents up to the one that reaches the cap
                lengths = sum(table.column(s).combine_chunks().value_lengths().to_numpy(
                    zero_copy_only=False) for s in SPLITS)
                written = sum(w.tokens for w in writers.values())
                reached = np.nonzero(written + np.cumsum(lengths) >= cfg.max_tokens)[0]
                if len(reached):
                    table = table.slice(0, int(reached[0]) + 1)
            for s in SPLITS:
                writers[s].write(table.column(s))
            documents += table.num_rows
            bar.update(table.num_rows)
            if cfg.max_tokens is not None and sum(w.tokens for w in writers.values()) >= cfg.max_tokens:
                break
        bar.close()
    finally:
        for w in writers.values():
            w.close()
    counts = {"documents": documents}
    for s, w in writers.items():
        counts.update({f"{s}_tokens": w.tokens, f"{s}_documents": w.documents, f"{s}_max_id": w.max_id})
    return tok, counts


def _check_counts(cfg: DataConfig, counts: dict) -> None:
    if counts["train_tokens"] + counts["val_tokens"] == 0:
        raise DataError(f"data {cfg.name!r}: the corpus is empty ({counts['documents']} documents, "
                        f"0 tokens from {_where(cfg)})")
    for split in SPLITS:
        if counts[f"{split}_tokens"] == 0:
            raise DataError(
                f"data {cfg.name!r}: the {split} split is empty ({counts['documents']} documents with "
                f"val_split={cfg.val_split}, val_fraction={cfg.val_fraction}); use val_split=tail "
                f"(the last fraction of every document) or more documents"
            )


# ---------------------------------------------------------------------------------------------
# the entry point


@contextlib.contextmanager
def _locked(root: Path):
    root.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock; atomic replaces still protect the files
        yield
        return
    with open(root / ".prepare.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _reusable(directory: Path, fp: str, announce: bool = False) -> dict | None:
    """The prepared dataset's meta if it is complete and was made from these sources and
    settings, else None; with ``announce``, say on the console why it is prepared again (for a
    hub dataset that means downloading it again)."""
    if not (directory / "meta.json").is_file():
        return None
    try:
        meta = load_meta(directory)
    except DataError as e:
        reason = str(e)
    else:
        if meta.get("fingerprint") == fp:
            return meta
        reason = "its sources or settings changed since it was prepared"
    if announce:
        log.warning("preparing %s again: %s", directory, reason)
        print(f"preparing {directory} again: {reason}", file=sys.stderr, flush=True)
    return None


def prepare_dataset(data_cfg: Any, data_root: str | os.PathLike = "data", *, progress: bool = True) -> dict:
    """The meta of one ``configs/data/*.yaml`` (``DictConfig``, dict or ``DataConfig``), tokenized
    into ``<data_root>/<name>/`` unless it is there already; token shards are read as they are."""
    cfg = DataConfig.from_any(data_cfg)
    source, root = source_for(cfg), Path(data_root)
    directory = root / cfg.name
    if not isinstance(source, DocumentSource):  # tokens as they are (shards): nothing to prepare
        return source.stored_meta(cfg, directory)
    inputs = source.fingerprint_inputs(cfg)  # raises for missing local files before any work
    fp = fingerprint(inputs)
    if (meta := _reusable(directory, fp)) is not None:
        log.info("reusing %s (fingerprint %s)", directory, fp)
        return meta
    if (problem := output_problem(str(root), OUTPUT_DIR)) is not None:
        raise DataError(f"data_root={root} {problem}")
    try:
        return _prepare_locked(cfg, root, directory, inputs, fp, progress)
    except FileNotFoundError:
        raise  # a missing input file: its message names it
    except OSError as e:  # a full or read-only disk under data_root, found while writing
        raise DataError(f"preparing {directory} failed writing ({first_line(e)}); free disk space "
                        "or point data_root at a writable directory") from None


def _prepare_locked(cfg: DataConfig, root: Path, directory: Path, inputs: dict, fp: str,
                    progress: bool) -> dict:
    with _locked(root):
        if (meta := _reusable(directory, fp, announce=True)) is not None:  # another process made it
            return meta
        for stale in root.glob(f".tmp-{cfg.name}-*"):  # left by a killed run (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{cfg.name}-", dir=root))
        try:
            start = time.perf_counter()
            with _progress_bars(progress):
                tok, counts = _tokenize_and_write(cfg, tmp, fp, progress)
            _check_counts(cfg, counts)
            meta = {
                "format_version": FORMAT_VERSION,
                "name": cfg.name,
                "tokenizer": tok.to_dict(),
                "vocab_size": tok.vocab_size,
                "eot_id": tok.eot_id,
                "dtype": dtype_for(tok.vocab_size).name,
                "train_tokens": counts["train_tokens"],
                "val_tokens": counts["val_tokens"],
                "documents": counts["documents"],
                "train_documents": counts["train_documents"],
                "val_documents": counts["val_documents"],
                "max_token_id": max(counts["train_max_id"], counts["val_max_id"]),
                "fingerprint": fp,
                "fingerprint_inputs": inputs,
                "seconds": round(time.perf_counter() - start, 3),
            }
            directory.mkdir(parents=True, exist_ok=True)
            # from here until meta.json is back, the directory reads as incomplete
            (directory / "meta.json").unlink(missing_ok=True)
            for split in SPLITS:
                os.replace(tmp / f"{split}.bin", directory / f"{split}.bin")
            atomic_write(directory / "meta.json",
                         lambda tmp: tmp.write_text(json.dumps(meta, indent=2) + "\n"))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("prepared %s: %d train + %d val tokens in %.1f s", directory, meta["train_tokens"],
             meta["val_tokens"], meta["seconds"])
    return meta
