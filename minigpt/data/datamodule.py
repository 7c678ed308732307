"""A run's data (``open_training_data``) and ``TokenDataModule``: token files -> batches.

Letters: B = batch size, T = context_length. A batch is ``(x, y)``, or ``(x, y, document_ids)``
for a ``document_mask`` model, int64 tensors of shape (B, T) with ``y[:, t] == x[:, t + 1]``.
Training batch ``b`` on rank ``r`` depends only on ``(seed, r, b)``, so a resumed run draws the
batches an uninterrupted one would; validation is a fixed set of rows, dealt out to the ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from minigpt.data.bos import PackedRows, aligned_rows, draw_rows
from minigpt.data.chat import Conversations
from minigpt.data.config import DataConfig, DataError
from minigpt.data.epochs import (
    ResumableBatches,
    batch_positions,
    epoch_rows,
    rank_batches,
    window_rows,
)
from minigpt.data.prepare import prepare_dataset
from minigpt.data.shards import ShardStream
from minigpt.data.sources import source_for
from minigpt.data.tokens import TokenFile, check_vocab_fits
from minigpt.documents import document_ids_of
from minigpt.tokenizer import Tokenizer, tokenizer_from_dict


def window_starts(seed: int, rank: int, batch_index: int, batch_size: int, n_tokens: int,
                  context_length: int) -> np.ndarray:
    """Start offsets of training batch ``batch_index`` on ``rank``: ``batch_size`` uniform draws
    from ``[0, n_tokens - context_length - 1]``, a pure function of its arguments."""
    rng = np.random.default_rng([seed, rank, batch_index])
    return rng.integers(0, n_tokens - context_length, size=batch_size)


def val_window_starts(n_tokens: int, context_length: int, token_budget: int) -> np.ndarray:
    """Evenly spaced, non-overlapping window starts covering the val split: at most
    ``token_budget // context_length`` windows (at least one)."""
    fit = (n_tokens - 1) // context_length
    n = max(1, min(token_budget // context_length, fit))
    return (np.arange(n) * (n_tokens - context_length - 1)) // max(n - 1, 1)


def open_training_data(cfg: Any, data_root: str | Path = "data", *, init_from: str | None = None,
                       progress: bool = True, log=print):
    """The data a run trains on, as ``data.source`` makes it (``Source.training_data``): a
    ``PreparedTokens`` or a ``Conversations``. ``init_from``: the weights the run starts from
    (conversations take their tokenizer and template); ``log``: where their packing is told."""
    cfg = DataConfig.from_any(cfg)
    return source_for(cfg).training_data(cfg, TrainingDataOpener(data_root, init_from,
                                                                 progress, log))


@dataclasses.dataclass
class TrainingDataOpener:
    """What ``Source.training_data`` calls to make a run's data of its kind."""

    data_root: str | Path
    init_from: str | None
    progress: bool
    log: Callable

    def tokens(self, cfg: DataConfig) -> PreparedTokens:
        return PreparedTokens(cfg, self.data_root, self.progress)

    def conversations(self, cfg: DataConfig) -> Conversations:
        return Conversations(cfg, self.init_from, self.log)


class PreparedTokens:
    """A run's tokens on disk, prepared if needed (``prepare_dataset``; token shards are read as
    they are); ``data_module`` serves them in batches once the model's context is known."""

    template = None  # no chat template: the loss trains on every token

    def __init__(self, config: DataConfig, data_root: str | Path, progress: bool = True):
        self.config, self.data_root = config, Path(data_root).expanduser().resolve()
        self.meta = prepare_dataset(config, self.data_root, progress=progress)
        self.tokenizer = tokenizer_from_dict(self.meta["tokenizer"])
        self.min_vocab = self.tokenizer.vocab_size  # the rows the ids need

    def check_vocab(self, vocab_size: int) -> None:
        """The data's own record of its largest token id against ``vocab_size`` rows."""
        check_vocab_fits(self.meta, vocab_size)

    def data_module(self, context_length: int, batch_size: int, *, seed: int, rank: int = 0,
                    world_size: int = 1, document_mask: bool = False,
                    pin_memory: bool = False) -> TokenDataModule:
        """The tokens in windows of ``context_length``, in batches of ``batch_size``, set up."""
        data = TokenDataModule(dataclasses.replace(self.config, batch_size=batch_size),
                               context_length, seed=seed, data_root=str(self.data_root),
                               rank=rank, world_size=world_size)
        data.pin_memory = pin_memory
        data.document_bos = self.tokenizer.eot_id if document_mask else None
        data.setup()
        return data


class _Windows(IterableDataset):
    """Base: batches of the windows at ``starts(worker, workers)``; the tokens (a ``TokenFile`` or
    a ``ShardStream``) are memory-mapped lazily in each worker (a pickled memmap is a copy)."""

    vocab_size: int | None = None  # ids at or above it stop the run, naming file and offset
    document_bos: int | None = None  # set: batches carry document_ids, each such token a start
    packed: PackedRows | None = None  # set (packing=best_fit): "starts" are its row numbers

    def __init__(self, tokens: TokenFile | ShardStream, context_length: int):
        self.tokens, self.n_tokens, self.T = tokens, len(tokens), context_length

    def _batch(self, tokens: np.ndarray, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        if self.packed is None:
            idx = starts[:, None] + np.arange(self.T + 1)  # (B, T+1)
        else:
            idx = self.packed.token_index(starts)  # (B, T+1)
        chunk = tokens[idx]  # (B, T+1)
        if self.vocab_size is not None:  # on the host, before the model sees it: no device sync
            self.tokens.check_batch(chunk, self.vocab_size, idx[:, 0])
        chunk = chunk.astype(np.int64)
        # Two contiguous tensors, not two views of one: the DataLoader pins each as it is, and
        # only a contiguous pinned tensor copies to the GPU asynchronously (non_blocking).
        x = torch.from_numpy(np.ascontiguousarray(chunk[:, :-1]))  # (B, T)
        y = torch.from_numpy(np.ascontiguousarray(chunk[:, 1:]))  # (B, T)
        if self.document_bos is None:
            return x, y
        return x, y, document_ids_of(x, self.document_bos)  # (B, T), made on the host

    def __iter__(self):
        tokens, info = self.tokens.open(), get_worker_info()
        for starts in self.starts(info.id if info else 0, info.num_workers if info else 1):
            yield self._batch(tokens, starts)


class RandomWindows(_Windows):
    """Endless training batches ``start_batch, start_batch + 1, ...`` (see ``window_starts``);
    with ``num_workers`` W > 0, worker w makes batches w, w + W, ... (the loader keeps the order)."""

    def __init__(self, tokens, context_length, batch_size, seed, rank, start_batch=0,
                 pool: np.ndarray | None = None):
        super().__init__(tokens, context_length)
        self.batch_size, self.seed, self.rank, self.start_batch = batch_size, seed, rank, start_batch
        self.pool = pool  # BOS-aligned: rows start at these document starts (minigpt.data.bos)
        # sampling=epoch: (rows, rows read before start_batch, processes); minigpt.data.epochs
        self.epochs: tuple[np.ndarray, int, int] | None = None

    def starts(self, worker: int, workers: int):
        for b in itertools.count(self.start_batch + worker, workers):
            if self.epochs is not None:
                rows, rows_read, world = self.epochs
                yield epoch_rows(self.seed, rows, batch_positions(
                    rows_read, b - self.start_batch, self.batch_size, self.rank, world))
            elif self.pool is not None:
                yield draw_rows(self.seed, self.rank, b, self.batch_size, self.pool)
            else:
                yield window_starts(self.seed, self.rank, b, self.batch_size, self.n_tokens, self.T)


class FixedWindows(_Windows):
    """Finite batches over the given batches of window starts, in order."""

    def __init__(self, tokens, context_length, batches: list[np.ndarray]):
        super().__init__(tokens, context_length)
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def starts(self, worker: int, workers: int):
        return self.batches[worker::workers]


class TokenDataModule(ResumableBatches):
    """Prepared token files (or shards) as batches: ``prepare_data()`` prepares them if needed,
    ``setup()`` makes the rows; ``meta``, ``tokenizer`` and ``vocab_size`` need only the files.
    ``rank`` and ``world_size`` say which process's share to deal out."""

    older = {"align": "window", "packing": "in_order", "sampling": "random"}  # before documents

    def __init__(self, data_cfg: Any, context_length: int, seed: int = 1337, data_root: str = "data",
                 *, rank: int = 0, world_size: int = 1):
        self.config = DataConfig.from_any(data_cfg)
        if not isinstance(context_length, int) or context_length < 1:
            raise ValueError(f"context_length={context_length!r} must be a positive integer")
        self.context_length, self.seed, self.data_root = context_length, int(seed), str(data_root)
        self.batch_size = self.config.batch_size
        self.directory = Path(data_root) / self.config.name
        self.rank, self.world_size = rank, world_size
        self.pin_memory = torch.cuda.is_available()  # the loop turns it off for CPU processes
        self._meta: dict | None = None
        self._val_starts: np.ndarray | None = None
        self._train_pool: np.ndarray | None = None  # BOS-aligned rows' document starts
        self._train_rows: np.ndarray | None = None  # sampling=epoch: the rows each epoch visits
        self._packed: dict[str, PackedRows] = {}  # packing=best_fit: each split's rows
        # set (the tokenizer's end-of-text id) for a document_mask model: batches are then
        # (x, y, document_ids), each such token beginning a document
        self.document_bos: int | None = None

    # ---- metadata --------------------------------------------------------------------------

    @property
    def meta(self) -> dict:
        """The source's ``stored_meta``: refusing files prepared from other sources or settings."""
        if self._meta is None:
            self._meta = source_for(self.config).stored_meta(self.config, self.directory)
        return self._meta

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        return tokenizer_from_dict(self.meta["tokenizer"])

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    @property
    def train_tokens(self) -> int:
        return self.meta["train_tokens"]

    def bytes_per_token(self, tokenizer, budget: int) -> float:
        """UTF-8 bytes per token over the first ``budget`` validation tokens (bits per byte)."""
        val = self.split_tokens("val")  # prepared tokens or shards
        tokens = val.open()[:min(budget, len(val))]
        return len(tokenizer.decode(tokens.tolist()).encode("utf-8")) / max(1, len(tokens))

    # ---- files ---------------------------------------------------------------------------

    def prepare_data(self) -> None:
        self._meta = prepare_dataset(self.config, self.data_root)

    def setup(self, stage: str | None = None) -> None:
        self._meta = None  # read again: another process may have prepared
        meta = self.meta
        need = self.context_length + 1
        for split in ("train", "val"):
            if meta[f"{split}_tokens"] < need:
                raise DataError(
                    f"the {split} split of {self.directory} has {meta[f'{split}_tokens']} tokens, "
                    f"fewer than one window of context_length + 1 = {need}; use more text or a "
                    f"smaller context_length"
                )
        self._train_rows = window_rows(meta["train_tokens"], self.context_length)
        if self.config.align == "bos":
            self._align_rows(meta)
        else:
            self._val_starts = val_window_starts(meta["val_tokens"], self.context_length,
                                                 self.config.val_tokens)

    def _align_rows(self, meta: dict) -> None:
        """BOS-aligned rows (``minigpt.data.bos``): the training pool of document starts and
        the validation rows (packed in order, evenly thinned to ``val_tokens``)."""
        bos, T = self.tokenizer.eot_id, self.context_length
        pools, rows = {}, {}
        for split in ("train", "val"):
            pools[split], rows[split], packed = aligned_rows(
                self.split_tokens(split).open(), bos, T, self.config.packing,
                f"the {split} split of {self.config.name}")
            if packed is not None:
                self._packed[split] = packed
        self._train_pool, self._train_rows = pools["train"], rows["train"]
        keep = max(1, min(len(rows["val"]), self.config.val_tokens // T))
        self._val_starts = rows["val"][np.linspace(0, len(rows["val"]) - 1, keep)
                                       .round().astype(int)]

    def split_tokens(self, split: str) -> TokenFile | ShardStream:
        """One split's token stream: the prepared flat file, or the shards its glob names."""
        return source_for(self.config).split_tokens(self.config, self.directory, self.meta,
                                                    split)

    def _loader(self, dataset: _Windows, split: str) -> DataLoader:
        dataset.vocab_size, dataset.document_bos = self.meta["vocab_size"], self.document_bos
        dataset.packed = self._packed.get(split)
        workers = self.config.num_workers
        return DataLoader(dataset, batch_size=None, num_workers=workers, pin_memory=self.pin_memory,
                          persistent_workers=split == "val" and workers > 0)

    def train_dataloader(self) -> DataLoader:
        if self._val_starts is None:
            self.setup("fit")
        dataset = RandomWindows(self.split_tokens("train"), self.context_length, self.batch_size,
                                self.seed, self.rank, start_batch=self.start_batch,
                                pool=self._train_pool)
        if self.config.sampling == "epoch":
            dataset.epochs = (self._train_rows, self.rows_read, self.world_size)
        return self._loader(dataset, "train")

    def _train_stream(self):
        return iter(self.train_dataloader())

    def val_dataloader(self) -> DataLoader:
        if self._val_starts is None:
            self.setup("validate")
        batches = rank_batches(self._val_starts, self.rank, self.world_size,
                               self.config.val_batch_size or self.batch_size, "window",
                               "raise data.val_tokens or val_fraction")
        return self._loader(FixedWindows(self.split_tokens("val"), self.context_length, batches),
                            "val")

    # ---- resumable state (stored in checkpoints: ResumableBatches) --------------------------

    def _settings(self) -> dict:
        settings = {"seed": self.seed, "batch_size": self.batch_size,
                    "context_length": self.context_length, "align": self.config.align,
                    "packing": self.config.packing, "sampling": self.config.sampling}
        if self._meta is not None:
            settings["fingerprint"] = self._meta.get("fingerprint")
        return settings
