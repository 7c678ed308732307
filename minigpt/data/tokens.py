"""Prepared token files, ``<data_root>/<name>/{train.bin, val.bin, meta.json}`` (nanoGPT's
layout: each ``.bin`` its split's flat token stream, native-endian ``uint16``, ``uint32`` past
65536 ids, no header), checked and read back; ``minigpt.data.prepare`` writes them."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from minigpt.data.config import DataError
from minigpt.errors import first_line
from minigpt.tokenizer import TIKTOKEN_ENCODINGS

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
SPLITS = ("train", "val")
SCAN_CHUNK = 1 << 24  # tokens per vectorized max over the memory map (32 MiB of uint16)
FULL_SCAN_TOKENS = 1 << 28  # files up to this many tokens are checked whole at every load


def dtype_for(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def load_meta(directory: str | os.PathLike) -> dict:
    """``meta.json`` of a prepared dataset, checked against its tokenizer, the ``.bin`` sizes and
    every token id (of files over ``FULL_SCAN_TOKENS``, both ends: ``check_token_ids`` checks the
    rest batch by batch); anything amiss is a one-line ``DataError`` naming the file and the fix."""
    directory = Path(directory)
    path = directory / "meta.json"
    if not path.is_file():
        raise DataError(f"no prepared data in {directory} (meta.json is missing): run "
                        f"python -m minigpt.data data={directory.name}")
    fix = (f"delete {directory} and prepare it again (python -m minigpt.data "
           f"data={directory.name}, or let train.py prepare it)")
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is unreadable ({first_line(e)}); {fix}") from None
    problem = _meta_problem(meta)
    if problem:
        raise DataError(f"{path}: {problem}; {fix}")
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in SPLITS:
        bin_path = directory / f"{split}.bin"
        expected = meta[f"{split}_tokens"] * itemsize
        actual = bin_path.stat().st_size if bin_path.is_file() else None
        if actual != expected:
            found = "is missing" if actual is None else f"has {actual} bytes"
            raise DataError(
                f"{bin_path} {found} but meta.json records {meta[f'{split}_tokens']} {meta['dtype']} "
                f"tokens ({expected} bytes): the file is truncated or changed; {fix}"
            )
        try:
            bad, skipped = find_bad_token(open_tokens(directory, split, meta), meta["vocab_size"])
        except OSError as e:  # unreadable: permissions, a disk error
            raise DataError(f"{bin_path} cannot be read ({first_line(e)}); {fix}") from None
        if bad is not None:
            raise DataError(f"{bin_path} holds token id {bad[1]} at token offset {bad[0]} but "
                            f"meta.json's tokenizer has {meta['vocab_size']} ids: the file is "
                            f"damaged or from another preparation; {fix}")
        if skipped:
            log.info("%s: checked the first and last %d token ids, skipped the %d between (the "
                     "training batches are checked as they are read)", bin_path,
                     FULL_SCAN_TOKENS // 2, skipped)
    return meta


def _meta_problem(meta) -> str | None:
    """What is wrong with a parsed meta.json on its own (None if nothing)."""
    if not isinstance(meta, dict):
        return "not a JSON object"
    if meta.get("format_version") != FORMAT_VERSION:
        return f"format_version={meta.get('format_version')!r}, this minigpt reads {FORMAT_VERSION}"
    for key, low in (("train_tokens", 0), ("val_tokens", 0), ("vocab_size", 1)):
        value = meta.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            return f"{key}={value!r} must be an integer >= {low}"
    vocab = meta["vocab_size"]
    tok = meta.get("tokenizer")
    if not isinstance(tok, dict) or tok.get("type") not in ("char", "tiktoken"):
        return f"tokenizer={tok!r} is not a minigpt tokenizer record"
    if tok["type"] == "char":
        chars = tok.get("chars")
        if not isinstance(chars, str) or len(set(chars)) != len(chars) or not chars:
            return "the char tokenizer's chars must be a string of distinct characters"
        expected_vocab, expected_eot = len(chars) + 1, len(chars)
    else:
        if tok.get("name") not in TIKTOKEN_ENCODINGS:
            return f"tokenizer name={tok.get('name')!r} must be one of {TIKTOKEN_ENCODINGS}"
        expected_vocab, expected_eot = tok.get("vocab_size"), tok.get("eot_id")
    if (tok.get("vocab_size"), tok.get("eot_id")) != (expected_vocab, expected_eot) \
            or vocab != expected_vocab:
        return (f"vocab_size={vocab} but its {tok.get('name')!r} tokenizer has "
                f"{expected_vocab} ids (eot_id {expected_eot})")
    if meta.get("dtype") != dtype_for(vocab).name:
        return f"dtype={meta.get('dtype')!r}, but {vocab} ids are stored as {dtype_for(vocab).name}"
    top = meta.get("max_token_id", -1)
    if isinstance(top, bool) or not isinstance(top, int) or not -1 <= top < vocab:
        return f"max_token_id={top!r} is outside the tokenizer's {vocab} ids"
    return None


def find_bad_token(tokens: np.ndarray, vocab_size: int, limit: int = FULL_SCAN_TOKENS,
                   chunk: int = SCAN_CHUNK) -> tuple[tuple[int, int] | None, int]:
    """``((offset, id) of the first id >= vocab_size or None, tokens skipped)``: a vectorized max
    over ``chunk``-token slices of the (memory-mapped) ``tokens``; a stream longer than ``limit``
    is checked in its first and last ``limit // 2`` tokens only."""
    n = len(tokens)
    spans = [(0, n)] if n <= limit else [(0, limit // 2), (n - limit // 2, n)]
    for start, end in spans:
        for a in range(start, end, chunk):
            part = tokens[a:min(a + chunk, end)]
            if int(part.max()) >= vocab_size:
                i = int(np.argmax(part >= vocab_size))
                return (a + i, int(part[i])), 0
    return None, max(0, n - limit) if n > limit else 0


def check_token_ids(batch: np.ndarray, vocab_size: int, path: str | os.PathLike,
                    offsets: Sequence[int]) -> None:
    """A one-line ``DataError`` naming the file and offset of the first id outside
    ``[0, vocab_size)`` in ``batch``: (B, L) ids on the host read from the prepared file ``path``,
    row ``i`` from its token offset ``offsets[i]``. One vectorized max: no device sync."""
    batch = np.asarray(batch)
    if batch.size == 0:
        return
    if int(batch.max()) < vocab_size and int(batch.min()) >= 0:
        return
    row, col = (int(i) for i in np.argwhere((batch >= vocab_size) | (batch < 0))[0])
    directory = Path(path).parent
    raise DataError(f"{path} holds token id {int(batch[row, col])} at token offset "
                    f"{int(offsets[row]) + col}, outside the model's {vocab_size} ids: the file "
                    f"is damaged or from another preparation; delete {directory} and prepare it "
                    f"again (python -m minigpt.data data={directory.name})")


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


class TokenFile:
    """One prepared split's flat token file, as the batches read it: ``len``, ``open()`` (a
    read-only memory map; open it in the process that reads it) and ``check_batch``."""

    def __init__(self, path: str | os.PathLike, dtype: str, n_tokens: int):
        self.path, self.dtype, self.n_tokens = Path(path), dtype, n_tokens

    def __len__(self) -> int:
        return self.n_tokens

    def open(self) -> np.memmap:
        return np.memmap(self.path, dtype=np.dtype(self.dtype), mode="r", shape=(self.n_tokens,))

    def check_batch(self, batch: np.ndarray, vocab_size: int, offsets: Sequence[int]) -> None:
        """``check_token_ids`` on a batch read from this file."""
        check_token_ids(batch, vocab_size, self.path, offsets)
