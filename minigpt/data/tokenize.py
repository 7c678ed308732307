"""Documents -> token ids per split: ``Tokenize``, the function ``datasets.map`` runs over a
source (long documents encoded in pieces, on threads; end-of-text appended to each).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np

from minigpt.data.config import DataError
from minigpt.tokenizer import CharTokenizer, Tokenizer, tokenizer_from_dict

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
