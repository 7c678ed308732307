"""llm.c / modded-nanogpt token shards (the format pre-tokenized FineWeb is published in): a
header of 256 little-endian int32 (``MAGIC``, ``VERSION``, the token count, zeros), then that many
little-endian uint16 GPT-2 ids, every document begun by end-of-text (its BOS). ``ShardStream``
reads a glob of them as one stream; ``python -m minigpt.data.shards`` writes a prepared dataset.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from minigpt.data.config import DataError
from minigpt.data.tokens import find_bad_token, load_meta, open_tokens
from minigpt.files import atomic_write
from minigpt.paths import glob_matches, input_problem
from minigpt.tokenizer import get_tokenizer

MAGIC, VERSION = 20240520, 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")
SHARD_TOKENS = 100_000_000  # tokens per shard llm.c writes (the last one holds the rest)


def shard_paths(pattern: str) -> list[Path]:
    """The files a glob names, sorted (shard 000000 first); none, or a match that is not a
    readable file (a directory, a link loop, a FIFO), is a ``DataError``."""
    paths = sorted(Path(p) for p in glob_matches(os.path.expanduser(pattern)))
    if not paths:
        raise DataError(f"no token shards match {pattern!r}; point the glob at llm.c .bin shards "
                        f"(e.g. data/fineweb10B/fineweb_train_*.bin)")
    for path in paths:
        if (problem := input_problem(str(path))) is not None:
            raise DataError(f"the shard glob {pattern!r} matches {path}, which {problem}")
    return paths


def read_header(path: str | os.PathLike) -> int:
    """The token count of the shard at ``path``, after checking its magic, version and size."""
    path = Path(path)
    fix = "re-download it or write it again (python -m minigpt.data.shards)"
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise DataError(f"{path} has {size} bytes, fewer than a shard's {HEADER_BYTES}-byte "
                        f"header: not an llm.c token shard; {fix}")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    magic, version, count = (int(v) for v in header[:3])
    if magic != MAGIC:
        raise DataError(f"{path} has magic number {magic}, not {MAGIC}: not an llm.c token "
                        f"shard; {fix}")
    if version != VERSION:
        raise DataError(f"{path} is shard version {version}, this minigpt reads version "
                        f"{VERSION} (uint16 tokens); {fix}")
    expected = HEADER_BYTES + count * TOKEN_DTYPE.itemsize
    if count < 0 or size != expected:
        raise DataError(f"{path} has {size} bytes but its header counts {count} tokens "
                        f"({expected} bytes): the shard is truncated or damaged; {fix}")
    return count


class ShardStream:
    """Shards as one read-only token stream: ``len``, integer-array indexing (any shape, rows may
    cross shard boundaries) and slices, read from the shards' memory maps; with ``vocab_size``,
    every id is checked against it when the stream opens."""

    dtype = TOKEN_DTYPE

    def __init__(self, paths: Sequence[str | os.PathLike], vocab_size: int | None = None):
        self.paths = [Path(p) for p in paths]
        self.counts = [read_header(p) for p in self.paths]
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self._maps: list[np.memmap] | None = None  # opened lazily (a pickled memmap is a copy)
        if vocab_size is not None:
            self.check_ids(vocab_size)

    @classmethod
    def from_glob(cls, pattern: str, vocab_size: int | None = None) -> ShardStream:
        return cls(shard_paths(pattern), vocab_size)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": None}

    @property
    def maps(self) -> list[np.memmap]:
        if self._maps is None:
            self._maps = [np.memmap(p, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(n,))
                          for p, n in zip(self.paths, self.counts, strict=True)]
        return self._maps

    def __getitem__(self, index) -> np.ndarray:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise IndexError("a ShardStream slice takes step 1 only")
            bounds = zip(self.maps, self.starts[:-1], self.starts[1:], strict=True)
            parts = [tokens[max(start, lo) - lo:min(stop, hi) - lo]  # each shard's share
                     for tokens, lo, hi in bounds if max(start, lo) < min(stop, hi)]
            if len(parts) == 1:
                return parts[0]
            return np.concatenate(parts) if parts else np.empty(0, self.dtype)
        index = np.asarray(index, dtype=np.int64)
        shard = np.searchsorted(self.starts, index, side="right") - 1
        out = np.empty(index.shape, dtype=self.dtype)
        for i in np.unique(shard):
            at = shard == i
            out[at] = self.maps[i][index[at] - self.starts[i]]
        return out

    def open(self) -> ShardStream:
        """The stream itself (the ``TokenFile`` interface; its maps open on first read)."""
        return self

    def check_batch(self, batch: np.ndarray, vocab_size: int, offsets: Sequence[int]) -> None:
        """Nothing (the ``TokenFile`` interface): every id was checked against the tokenizer's
        when the run opened the shards (``shards_meta``)."""

    def check_ids(self, vocab_size: int) -> None:
        """A ``DataError`` naming the shard and offset of the first id >= ``vocab_size``. A
        shard found clean is not read again by this process while its file is unchanged."""
        for path, tokens in zip(self.paths, self.maps, strict=True):
            stat = path.stat()
            seen = (str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns, vocab_size)
            if seen in _CLEAN:
                continue
            bad, _ = find_bad_token(tokens, vocab_size, limit=len(tokens) + 1)
            if bad is not None:
                raise DataError(f"{path} holds token id {bad[1]} at token offset {bad[0]}, beyond "
                                f"the tokenizer's {vocab_size} ids: the shard is damaged or from "
                                "another tokenizer; re-download it or write it again")
            _CLEAN.add(seen)


_CLEAN: set[tuple] = set()  # shards ShardStream.check_ids read whole and found clean


def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write ``tokens`` (ids < 65536) as one shard, atomically (llm.c's header)."""
    tokens = np.asarray(tokens)
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= 1 << 16):
        raise DataError(f"{path}: token ids must fit uint16 (0..65535) for an llm.c shard, got "
                        f"{int(tokens.min())}..{int(tokens.max())}")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = MAGIC, VERSION, len(tokens)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            f.write(tokens.astype(TOKEN_DTYPE, copy=False).tobytes())

    atomic_write(path, write)


def write_shards(tokens: np.ndarray, directory: str | os.PathLike, prefix: str,
                 shard_tokens: int = SHARD_TOKENS) -> list[Path]:
    """Write a token stream as ``<directory>/<prefix>_000000.bin``, ... of ``shard_tokens``
    tokens each (the last holds the rest); returns the paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for n, start in enumerate(range(0, max(len(tokens), 1), shard_tokens)):
        path = directory / f"{prefix}_{n:06d}.bin"
        write_shard(path, tokens[start:start + shard_tokens])
        paths.append(path)
    return paths


def bos_first(flat_tokens: np.ndarray, eot_id: int) -> np.ndarray:
    """A prepared flat stream (an end-of-text token AFTER each document, minigpt's layout) as
    a shard stream (the token BEFORE each document, llm.c's): the same tokens shifted by one."""
    if len(flat_tokens) == 0:
        return np.asarray(flat_tokens)
    return np.concatenate([[eot_id], flat_tokens[:-1]]).astype(flat_tokens.dtype)


def shards_meta(config) -> dict:
    """A ``source=shards`` config as a prepared dataset's meta: GPT-2's tokenizer, uint16, the
    token counts and a fingerprint of the shards' names and counts; every id checked (once per
    process and shard)."""
    tokenizer = get_tokenizer("gpt2")
    meta = {"name": config.name, "dtype": "uint16", "vocab_size": tokenizer.vocab_size,
            "tokenizer": tokenizer.to_dict()}
    identity = []
    for split in ("train", "val"):
        stream = ShardStream.from_glob(getattr(config, f"{split}_shards"), tokenizer.vocab_size)
        meta[f"{split}_tokens"] = len(stream)
        identity += [(p.name, n) for p, n in zip(stream.paths, stream.counts, strict=True)]
    meta["fingerprint"] = hashlib.sha256(repr(identity).encode()).hexdigest()[:20]
    return meta


def shards_from_prepared(directory: str | os.PathLike, out: str | os.PathLike,
                         shard_tokens: int = SHARD_TOKENS) -> dict[str, list[Path]]:
    """Write a prepared dataset (``python -m minigpt.data``) as shards ``<out>/<name>_train_*``
    and ``<name>_val_*``: the same tokens, a BOS before each document instead of an
    end-of-text after it. Its tokenizer must be GPT-2's ids (what shards hold)."""
    directory = Path(directory)
    meta = load_meta(directory)
    tokenizer = meta["tokenizer"]
    if tokenizer.get("name") != "gpt2":
        raise DataError(f"{directory} holds {tokenizer.get('name')!r} token ids; llm.c shards "
                        f"hold GPT-2's: prepare it with data.tokenizer=gpt2")
    return {split: write_shards(bos_first(open_tokens(directory, split, meta),
                                          tokenizer["eot_id"]),
                                out, f"{directory.name}_{split}", shard_tokens)
            for split in ("train", "val")}


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m minigpt.data.shards <prepared dir> <out dir>``: a prepared dataset as shards."""
    import argparse

    from minigpt.errors import one_line_errors

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("prepared", help="a prepared dataset, e.g. data/shakespeare")
    parser.add_argument("out", help="directory to write <name>_{train,val}_000000.bin into")
    parser.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS)
    args = parser.parse_args(argv)
    with one_line_errors():
        written = shards_from_prepared(args.prepared, args.out, args.shard_tokens)
    for split, paths in written.items():
        print(f"{split}: {len(paths)} shard(s), {paths[0].parent}/{paths[0].name} ...")


if __name__ == "__main__":
    main()
