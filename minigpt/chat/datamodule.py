"""``ChatDataModule``: packed conversation rows (in memory) -> batches for the training loop.

It hands the loop what ``TokenDataModule`` does: ``train_batches()`` (rows drawn uniformly,
batch ``b`` on rank ``r`` a pure function of ``(seed, r, b)``, so a resumed run draws the
batches an uninterrupted one would), ``val_dataloader()`` (every validation row once, dealt out
to the ranks), ``state_dict()`` / ``load_state_dict()``; and ``template``, the chat template
the checkpoints store. Batches are ``(x, y)`` or ``(x, y, document_ids)``, (B, T) int64, with
``y`` = ``IGNORE_INDEX`` where nothing trains (``minigpt.chat.rows``).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from minigpt.chat.rows import PackReport, pack_rows
from minigpt.data.bos import draw_rows
from minigpt.data.chat import ChatSettings
from minigpt.data.config import DataConfig, DataError
from minigpt.data.datamodule import CountedBatches
from minigpt.documents import document_ids_of

Rows = tuple[np.ndarray, np.ndarray]  # x, y: (N, T) int64


class ChatDataModule:
    """Packed conversation rows as batches (see the module docstring)."""

    def __init__(self, config: DataConfig, template, train: Rows, val: Rows, seed: int = 1337,
                 *, rank: int = 0, world_size: int = 1):
        self.config, self.template = config, template
        self.train_rows, self.val_rows = train, val
        self.batch_size = config.batch_size
        self.context_length = train[0].shape[1]
        self.seed, self.rank, self.world_size = int(seed), rank, world_size
        self.start_batch = 0  # first training batch to draw; set from checkpoints on resume
        self.drawn = 0  # training batches handed out since start_batch (CountedBatches counts)
        self.pin_memory = False
        self.document_bos: int | None = None  # set: batches carry document_ids

    def setup(self, stage: str | None = None) -> None:
        """Nothing to do: the rows are in memory."""

    def _batch(self, rows: Rows, index: np.ndarray) -> tuple[torch.Tensor, ...]:
        x = torch.from_numpy(rows[0][index])  # (B, T)
        y = torch.from_numpy(rows[1][index])  # (B, T)
        batch = (x, y) if self.document_bos is None else (x, y, document_ids_of(x, self.document_bos))
        return tuple(t.pin_memory() for t in batch) if self.pin_memory else batch

    def _train_stream(self):
        pool = np.arange(len(self.train_rows[0]))
        b = self.start_batch
        while True:
            yield self._batch(self.train_rows, draw_rows(self.seed, self.rank, b, self.batch_size,
                                                         pool))
            b += 1

    def train_batches(self) -> CountedBatches:
        """The endless training stream from ``start_batch``, counted in ``drawn``."""
        self.drawn = 0
        return CountedBatches(self._train_stream(), self)

    def val_dataloader(self) -> list[tuple[torch.Tensor, ...]]:
        """This rank's share of the validation rows, in batches (every rank the same number)."""
        n = len(self.val_rows[0])
        per_rank = n // self.world_size
        if per_rank == 0:
            raise DataError(f"{n} validation row(s) cannot be shared by {self.world_size} "
                            "processes: hold out more conversations (data.val_fraction)")
        mine = np.arange(n)[self.rank::self.world_size][:per_rank]
        size = self.config.val_batch_size or self.batch_size
        return [self._batch(self.val_rows, mine[i:i + size]) for i in range(0, per_rank, size)]

    @property
    def batches_consumed(self) -> int:
        return self.start_batch + self.drawn

    def state_dict(self) -> dict:
        return {"batches_consumed": self.batches_consumed, "seed": self.seed,
                "batch_size": self.batch_size, "context_length": self.context_length,
                "train_rows": len(self.train_rows[0])}

    def load_state_dict(self, state: dict) -> None:
        self.start_batch, self.drawn = int(state["batches_consumed"]), 0
        now = {"seed": self.seed, "batch_size": self.batch_size,
               "context_length": self.context_length, "train_rows": len(self.train_rows[0])}
        changed = [f"{k}: {state.get(k)} -> {v}" for k, v in now.items() if state.get(k) != v]
        if changed:
            warnings.warn(f"resuming with different chat data ({', '.join(changed)}): training "
                          f"continues at batch {self.start_batch}, but not with the batches the "
                          "original run would have drawn", stacklevel=2)


def pack_split(conversations, config: DataConfig, settings: ChatSettings, context_length: int,
               pad_id: int, split: str) -> tuple[Rows, PackReport]:
    """One split's rows and what packing did; ``DataError`` when no row is left."""
    x, y, report = pack_rows(conversations, context_length, pad_id, settings.rows,
                             settings.too_long)
    if not len(x):
        raise DataError(f"no {split} conversation of data={config.name} fits a row of "
                        f"context_length + 1 = {context_length + 1} tokens with a trained token "
                        f"({report.describe(split, context_length + 1)}); use shorter "
                        "conversations or data.source_args.too_long=truncate")
    return (x, y), report
