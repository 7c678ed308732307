"""Tokenizers: one small interface over tiktoken encodings and an offline character tokenizer,
round-tripped through plain JSON (``to_dict``, ``tokenizer_from_dict``). ``encode`` treats
special-token text as ordinary text: only the data pipeline inserts ``eot_id``.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache, partial

import numpy as np

from minigpt.errors import UserError, first_line

TIKTOKEN_ENCODINGS = ("gpt2", "r50k_base", "p50k_base", "cl100k_base", "o200k_base")
EOT_TEXT = "<|endoftext|>"


class TokenizerUnavailableError(UserError, RuntimeError):
    """A tiktoken encoding could not be loaded (typically offline, with no cached files)."""


class Tokenizer(ABC):
    """What the rest of minigpt uses: ``encode``, ``decode``, ``vocab_size``, ``eot_id``."""

    name: str
    vocab_size: int
    eot_id: int

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Text -> token ids, without any special tokens."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Token ids -> text; ``eot_id`` decodes to ``"<|endoftext|>"``."""

    @abstractmethod
    def to_dict(self) -> dict:
        """Everything needed to rebuild this tokenizer, as plain JSON types."""

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1,
                     transform: Callable[[str], str] | None = None) -> list[np.ndarray]:
        """Encode many texts to uint32 arrays, ``transform`` applied to each text first."""
        return [np.asarray(self.encode(transform(t) if transform else t), dtype=np.uint32)
                for t in texts]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


def _load_encoding(name: str):
    import tiktoken

    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # tiktoken raises network, hash and I/O errors from deep inside
        cache = os.environ.get("TIKTOKEN_CACHE_DIR", "unset")
        raise TokenizerUnavailableError(
            f"cannot load the tiktoken encoding {name!r} ({first_line(e, 120)}); it is "
            f"downloaded once and cached: offline, set TIKTOKEN_CACHE_DIR to a folder holding the "
            f"cached files (now: {cache}) or use the character tokenizer with data=shakespeare_char"
        ) from None


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE encoding (``gpt2``, ``r50k_base``, ``cl100k_base``, ``o200k_base``, ...)."""

    def __init__(self, name: str = "gpt2"):
        if name not in TIKTOKEN_ENCODINGS:
            raise ValueError(f"unknown tiktoken encoding {name!r}; choose one of "
                             f"{TIKTOKEN_ENCODINGS}")
        self.name = name
        self._enc = _load_encoding(name)
        self.vocab_size = self._enc.n_vocab
        self.eot_id = self._enc.eot_token
        self._pool: ThreadPoolExecutor | None = None
        self._pool_key: tuple[int, int] | None = None
        self._local = threading.local()

    def __getstate__(self):  # threads and Rust objects do not pickle; the name rebuilds them
        return {"name": self.name}

    def __setstate__(self, state):
        self.__init__(state["name"])

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids])

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1,
                     transform: Callable[[str], str] | None = None) -> list[np.ndarray]:
        # tiktoken's Rust core releases the GIL, so threads overlap encoding with ``transform``
        if num_threads <= 1 or len(texts) <= 1:
            return [self._enc.encode_to_numpy(transform(t) if transform else t,
                                              disallowed_special=()) for t in texts]
        key = (num_threads, os.getpid())  # a forked child inherits the pool object, not its threads
        if self._pool is None or self._pool_key != key:
            self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix=f"tiktoken-{self.name}")
            self._pool_key = key
        return list(self._pool.map(partial(self._encode_in_worker, transform=transform), texts))

    def _encode_in_worker(self, text: str, transform: Callable[[str], str] | None) -> np.ndarray:
        # An Encoding runs slower in threads other than the first to use it (its regex caches
        # favour that thread), so each worker thread builds and alone uses its own copy.
        enc = getattr(self._local, "enc", None)
        if enc is None:
            import tiktoken

            base = self._enc
            enc = self._local.enc = tiktoken.Encoding(
                base.name, pat_str=base._pat_str, mergeable_ranks=base._mergeable_ranks,
                special_tokens=base._special_tokens)
        return enc.encode_to_numpy(transform(text) if transform else text, disallowed_special=())

    def to_dict(self) -> dict:
        return {"type": "tiktoken", "name": self.name, "vocab_size": self.vocab_size,
                "eot_id": self.eot_id}


class CharTokenizer(Tokenizer):
    """Character-level tokenizer: ids ``0..n-1`` are the sorted characters, ``n`` is end-of-text."""

    name = "char"

    def __init__(self, chars: str | Sequence[str]):
        chars = list(chars)
        if not chars or any(len(c) != 1 for c in chars) or len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer needs a non-empty sequence of distinct single "
                             "characters")
        self.chars = chars
        self.eot_id = len(chars)
        self.vocab_size = len(chars) + 1
        self._stoi = {c: i for i, c in enumerate(chars)}
        # code point -> id (-1: unknown), for vectorised batch encoding
        self._table = np.full(max(map(ord, chars)) + 1, -1, dtype=np.int64)
        self._table[[ord(c) for c in chars]] = np.arange(len(chars))

    @classmethod
    def from_text(cls, text: str | Iterable[str]) -> CharTokenizer:
        """Every distinct character of a text (or an iterable of texts), sorted."""
        seen: set[str] = set()
        for t in [text] if isinstance(text, str) else text:
            seen.update(t)
        if not seen:
            raise ValueError("cannot build a character tokenizer from empty text")
        return cls(sorted(seen))

    def _unknown_error(self, text: str) -> ValueError:
        unknown = sorted(set(text) - self._stoi.keys())
        shown = ", ".join(repr(c) for c in unknown[:20]) + (" ..." if len(unknown) > 20 else "")
        return ValueError(
            f"{len(unknown)} character(s) not in the character tokenizer's vocabulary "
            f"(built from the training corpus): {shown}"
        )

    def encode(self, text: str) -> list[int]:
        try:
            return [self._stoi[c] for c in text]
        except KeyError:
            raise self._unknown_error(text) from None

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1,
                     transform: Callable[[str], str] | None = None) -> list[np.ndarray]:
        out = []
        for text in texts:
            text = transform(text) if transform else text
            cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
            ids = self._table[np.minimum(cps, len(self._table) - 1)]
            if (ids < 0).any() or (cps >= len(self._table)).any():
                raise self._unknown_error(text)
            out.append(ids.astype(np.uint32))
        return out

    def decode(self, ids: Iterable[int]) -> str:
        parts = []
        for i in map(int, ids):
            if not 0 <= i <= self.eot_id:
                raise ValueError(f"token id {i} is outside the character vocabulary (size "
                                 f"{self.vocab_size})")
            parts.append(EOT_TEXT if i == self.eot_id else self.chars[i])
        return "".join(parts)

    def to_dict(self) -> dict:
        return {"type": "char", "name": self.name, "chars": "".join(self.chars),
                "vocab_size": self.vocab_size, "eot_id": self.eot_id}


@cache
def _tiktoken_tokenizer(name: str) -> TiktokenTokenizer:
    # one per encoding and process, so its worker threads and their Encodings are built once
    return TiktokenTokenizer(name)


def get_tokenizer(name: str, **kw) -> Tokenizer:
    """A tokenizer by name: a tiktoken encoding, or ``"char"`` with ``text=`` or ``chars=``."""
    if name == "char":
        if "chars" in kw:
            return CharTokenizer(kw["chars"])
        if "text" in kw:
            return CharTokenizer.from_text(kw["text"])
        raise ValueError("the char tokenizer is built from a corpus: pass text=... or chars=...")
    if name in TIKTOKEN_ENCODINGS:
        return _tiktoken_tokenizer(name)
    raise ValueError(f"unknown tokenizer {name!r}; choose 'char' or one of {TIKTOKEN_ENCODINGS}")


def tokenizer_from_dict(d: dict) -> Tokenizer:
    """Rebuild a tokenizer from ``Tokenizer.to_dict()`` output (meta.json, checkpoints)."""
    kind = d.get("type")
    if kind == "char":
        tok: Tokenizer = CharTokenizer(d["chars"])
    elif kind == "tiktoken":
        tok = get_tokenizer(d["name"])
    else:
        raise ValueError(f"unknown tokenizer type {kind!r} in {sorted(d)}")
    stored = (d.get("vocab_size", tok.vocab_size), d.get("eot_id", tok.eot_id))
    if stored != (tok.vocab_size, tok.eot_id):
        raise ValueError(f"tokenizer {tok.name!r} now has vocab_size={tok.vocab_size}, eot_id="
                         f"{tok.eot_id} but was saved with vocab_size={stored[0]}, eot_id="
                         f"{stored[1]}")
    return tok
