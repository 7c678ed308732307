"""Prepared token files on disk: where they live, their ``meta.json``, and reading them back.

Layout (nanoGPT's): ``<data_root>/<name>/{train.bin, val.bin, meta.json}``; each ``.bin`` is the
flat token stream of its split, native-endian ``uint16`` (``uint32`` when the vocabulary has more
than 65536 ids), no header. ``minigpt.data.prepare`` writes them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from minigpt.data.config import DataConfig, DataError

FORMAT_VERSION = 1
SPLITS = ("train", "val")


def dtype_for(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def dataset_dir(data_cfg: Any, data_root: str | os.PathLike = "data") -> Path:
    return Path(data_root) / DataConfig.from_any(data_cfg).name


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
