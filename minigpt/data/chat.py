"""``data.source=chat``: conversations (``.jsonl`` files or a Hugging Face dataset, in the
messages or the instruction form of docs/chat.md) rendered with the chat template and packed into
rows in memory when the run starts (``Conversations``); nothing is prepared on disk.

Letters: N rows, T = context_length. A row holds T + 1 tokens: whole conversations, each from its
BOS, one after another (``packed``) or one a row (``padded``), padded with the BOS id.
``x = row[:-1]``; ``y = row[1:]`` where the rendered mask trains and ``IGNORE_INDEX`` elsewhere.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from minigpt import files
from minigpt.chat.template import ChatFormatError, ChatTemplate, read_chat_template
from minigpt.checkpoint import METADATA_KEY, read_checkpoint
from minigpt.data.bos import draw_rows
from minigpt.data.config import DataConfig, DataError
from minigpt.data.epochs import ResumableBatches, rank_batches
from minigpt.data.sources import load_hub
from minigpt.documents import document_ids_of
from minigpt.field_rules import OneOf, field_problems
from minigpt.model import IGNORE_INDEX
from minigpt.paths import INPUT_GLOBS, expand_paths, path_field
from minigpt.tokenizer import CharTokenizer, Tokenizer, get_tokenizer, tokenizer_from_dict

ROW_MODES = ("packed", "padded")
TOO_LONG = ("drop", "truncate")
TRAIN_ON = ("assistant", "all")


@dataclass
class PackReport:
    """What packing did, for one line of the run's output."""

    conversations: int = 0  # kept
    rows: int = 0
    too_long: int = 0  # longer than a row: dropped or truncated (see ``too_long_action``)
    too_long_action: str = "drop"
    untrained: int = 0  # dropped: no trained token (no assistant turn, or truncated before it)
    tokens: int = 0  # tokens of kept conversations in rows
    trained: int = 0  # targets that train

    def describe(self, split: str, row_tokens: int) -> str:
        used = self.tokens / max(1, self.rows * row_tokens)
        line = (f"chat {split}: {self.conversations:,} conversations in {self.rows:,} rows of "
                f"{row_tokens} tokens ({used:.0%} filled), {self.trained:,} trained targets")
        if self.too_long:
            done = "dropped" if self.too_long_action == "drop" else "truncated"
            line += f"; {self.too_long:,} longer than a row {done} (data.source_args.too_long)"
        if self.untrained:
            line += f"; {self.untrained:,} without a trained token dropped"
        return line


def train_on_all(mask: list[bool]) -> list[bool]:
    """``train_on=all``: every token of the conversation but its BOS is a target."""
    return [False] + [True] * (len(mask) - 1)


def pack_rows(conversations: Iterable[tuple[list[int], list[bool]]], context_length: int,
              pad_id: int, rows: str = "packed", too_long: str = "drop"
              ) -> tuple[np.ndarray, np.ndarray, PackReport]:
    """``(x, y, report)``: int64 (N, T) inputs and targets (the module docstring), in the
    conversations' order; one longer than T + 1 tokens is dropped or truncated (``too_long``), one
    with no trained token left is dropped."""
    if rows not in ROW_MODES or too_long not in TOO_LONG:
        raise ValueError(f"rows={rows!r} must be one of {ROW_MODES}, too_long={too_long!r} one "
                         f"of {TOO_LONG}")
    row_len = context_length + 1
    report = PackReport(too_long_action=too_long)
    packed: list[tuple[list[int], list[bool]]] = []
    for ids, mask in conversations:
        if len(ids) > row_len:
            report.too_long += 1
            if too_long == "drop":
                continue
            ids, mask = ids[:row_len], mask[:row_len]
        if not any(mask[1:]):
            report.untrained += 1
            continue
        report.conversations += 1
        report.tokens += len(ids)
        if rows == "packed" and packed and len(packed[-1][0]) + len(ids) <= row_len:
            packed[-1][0].extend(ids)
            packed[-1][1].extend(mask)
        else:
            packed.append((list(ids), list(mask)))
    report.rows = len(packed)
    tokens = np.full((len(packed), row_len), pad_id, dtype=np.int64)  # (N, T+1)
    trained = np.zeros((len(packed), row_len), dtype=bool)  # (N, T+1)
    for r, (ids, mask) in enumerate(packed):
        tokens[r, :len(ids)], trained[r, :len(mask)] = ids, mask
    x = tokens[:, :-1]  # (N, T)
    y = np.where(trained[:, 1:], tokens[:, 1:], IGNORE_INDEX)  # (N, T)
    report.trained = int(trained[:, 1:].sum())
    return np.ascontiguousarray(x), np.ascontiguousarray(y), report


class ChatDataError(DataError):
    """A conversation record that cannot be read: one line naming the file, line and field."""


def conversation_of(record) -> list[dict]:
    """The messages of a record in the messages or the instruction form; ``ValueError`` naming
    the field otherwise."""
    if not isinstance(record, dict):  # a hub dataset's row; read_jsonl checks its lines
        raise ValueError(f"a record is a JSON object, not {type(record).__name__}")
    if "messages" in record:
        return record["messages"]
    if "instruction" in record or "output" in record:
        for key in ("instruction", "output"):
            if not isinstance(record.get(key), str):
                raise ValueError(f"field {key!r} is missing or not a string "
                                 "(instruction records need 'instruction' and 'output')")
        extra = record.get("input") or ""
        if not isinstance(extra, str):
            raise ValueError(f"field 'input' is {type(extra).__name__}, not a string")
        user = record["instruction"] + (f"\n\n{extra}" if extra else "")
        return [{"role": "user", "content": user},
                {"role": "assistant", "content": record["output"]}]
    raise ValueError(f"no field 'messages' or 'instruction' (fields: {', '.join(record) or 'none'})")


def read_jsonl(path: str) -> list[tuple[str, list[dict]]]:
    """``(path:line, messages)`` of each non-blank line of a ``.jsonl`` file."""
    return files.read_jsonl(path, checked, ChatDataError)


def checked(record, where: str) -> tuple[str, list[dict]]:
    """``(where, conversation_of(record))``, its error prefixed by ``where``."""
    try:
        return where, conversation_of(record)
    except ValueError as e:
        raise ChatDataError(f"{where}: {e}") from None


VAL_SEED = 0  # which conversations are held out does not change with the run's seed
Rows = tuple[np.ndarray, np.ndarray]  # x, y: (N, T) int64


@dataclass
class ChatSettings:
    """``data.source_args`` of ``data=chat``."""

    # held-out .jsonl files; [] = val_fraction
    val_paths: list[str] = path_field(INPUT_GLOBS, default_factory=list)
    train_on: str = "assistant"  # assistant: the loss on replies only; all: on every token
    rows: str = "packed"  # packed: whole conversations packed into rows; padded: one per row
    too_long: str = "drop"  # a conversation longer than a row: drop | truncate (counted)

    @classmethod
    def from_args(cls, args: dict) -> ChatSettings:
        """From ``data.source_args``; every bad or unknown key in one ``DataError`` line."""
        known = {f.name for f in dataclasses.fields(cls)}
        settings = cls(**{k: v for k, v in args.items() if k in known})
        if isinstance(settings.val_paths, str):
            settings.val_paths = [settings.val_paths]
        problems = [f"unknown data.source_args.{k} (known: {', '.join(sorted(known))})"
                    for k in sorted(set(args) - known)]
        rules = {"train_on": OneOf(TRAIN_ON), "rows": OneOf(ROW_MODES), "too_long": OneOf(TOO_LONG)}
        problems += field_problems(settings, rules, "data.source_args.")
        if problems:
            raise DataError("bad chat data config: " + "; ".join(problems))
        return settings


class Conversations:
    """A run's conversations (``ChatSource.training_data``): read when made, rendered and packed
    by ``data_module`` once the model's context is known; ``log`` gets one line per split saying
    how they were packed."""

    def __init__(self, config: DataConfig, init_from: str | None, log=print):
        self.config, self.log = config, log
        self.settings = ChatSettings.from_args(config.source_args)
        self.train_records, self.val_records = read_conversations(config, self.settings)
        self.tokenizer, stored = chat_tokenizer(config, init_from,
                                                self.train_records + self.val_records)
        self.template = stored or ChatTemplate.for_tokenizer(self.tokenizer)
        self.min_vocab = self.template.min_vocab_size  # the rows the ids need

    def check_vocab(self, vocab_size: int) -> None:
        """Nothing beyond ``min_vocab``: every id is the tokenizer's or the template's."""

    def data_module(self, context_length: int, batch_size: int, *, seed: int, rank: int = 0,
                    world_size: int = 1, document_mask: bool = False,
                    pin_memory: bool = False) -> ChatDataModule:
        """The conversations as rows of ``context_length`` tokens, in batches of ``batch_size``."""
        T, splits, reports = context_length, {}, {}
        for split, records in (("train", self.train_records), ("val", self.val_records)):
            rendered = render_all(self.template, records, self.settings.train_on)
            x, y, report = pack_rows(rendered, T, self.template.bos_id, self.settings.rows,
                                     self.settings.too_long)
            if not len(x):
                raise DataError(f"no {split} conversation of data={self.config.name} fits a row "
                                f"of context_length + 1 = {T + 1} tokens with a trained token "
                                f"({report.describe(split, T + 1)}); use shorter conversations "
                                "or data.source_args.too_long=truncate")
            self.log(report.describe(split, T + 1))
            splits[split], reports[split] = (x, y), report
        return ChatDataModule(dataclasses.replace(self.config, batch_size=batch_size),
                              self.template, splits["train"], splits["val"], seed=seed,
                              rank=rank, world_size=world_size, pin_memory=pin_memory,
                              document_bos=self.template.bos_id if document_mask else None,
                              train_tokens=reports["train"].tokens)


def read_conversations(config: DataConfig, settings: ChatSettings):
    """``(train, val)`` lists of ``(where, messages)``: ``data.paths`` or the hub dataset;
    validation from ``val_paths``, else a fixed ``val_fraction`` of them held out."""
    if config.paths:
        records = [r for path in expand_paths(config.paths, "data.paths") for r in read_jsonl(path)]
    else:
        rows = load_hub(config, "use local .jsonl files in data.paths")
        records = [checked(r, f"dataset {config.hub_name!r} row {i}") for i, r in enumerate(rows)]
    records = records[:config.max_documents]
    if settings.val_paths:
        val_files = expand_paths(settings.val_paths, "data.source_args.val_paths")
        return records, [r for path in val_files for r in read_jsonl(path)]
    held = max(1, round(len(records) * config.val_fraction))
    if held >= len(records):
        raise ChatDataError(f"data={config.name}: {len(records)} conversation(s) are too few to "
                            f"hold out val_fraction={config.val_fraction}; add conversations or "
                            "give data.source_args.val_paths")
    val_index = set(np.random.default_rng(VAL_SEED).permutation(len(records))[:held].tolist())
    return ([r for i, r in enumerate(records) if i not in val_index],
            [r for i, r in enumerate(records) if i in val_index])


def chat_tokenizer(config: DataConfig, init_from: str | None, records
                   ) -> tuple[Tokenizer, ChatTemplate | None]:
    """The run's tokenizer, and the template ``init_from`` stored (None: a new one)."""
    if init_from:
        path = Path(init_from).expanduser()
        if path.is_dir():  # a Hugging Face GPT-2 directory
            return get_tokenizer("gpt2"), None
        meta = read_checkpoint(path)[METADATA_KEY]
        tokenizer = tokenizer_from_dict(meta["tokenizer"])
        return tokenizer, read_chat_template(meta, tokenizer)
    if config.tokenizer == "char":
        texts = (m.get("content") for _, messages in records for m in messages
                 if isinstance(m, dict))
        return CharTokenizer.from_text(t for t in texts if isinstance(t, str)), None
    return get_tokenizer(config.tokenizer), None


def render_all(template: ChatTemplate, records, train_on: str) -> list[tuple[list, list]]:
    """Each conversation's ``(ids, train_mask)``; a bad message names where it is."""
    rendered = []
    for where, messages in records:
        try:
            ids, mask = template.render(messages)
        except ChatFormatError as e:
            raise ChatDataError(f"{where}: {e}") from None
        rendered.append((ids, train_on_all(mask) if train_on == "all" else mask))
    return rendered


class ChatDataModule(ResumableBatches):
    """Packed conversation rows as batches: training rows drawn uniformly (batch ``b`` on rank
    ``r`` a pure function of ``(seed, r, b)``), every validation row once; ``template``: the chat
    template the checkpoints store."""

    def __init__(self, config: DataConfig, template, train: Rows, val: Rows, seed: int = 1337,
                 *, rank: int = 0, world_size: int = 1, pin_memory: bool = False,
                 document_bos: int | None = None, train_tokens: int = 0):
        self.config, self.template = config, template
        self.train_rows, self.val_rows = train, val
        self.batch_size = config.batch_size
        self.context_length = train[0].shape[1]
        self.seed, self.rank, self.world_size = int(seed), rank, world_size
        self.pin_memory = pin_memory
        self.document_bos = document_bos  # set: batches carry document_ids
        self.train_tokens = train_tokens  # tokens of the conversations in the training rows

    def _batch(self, rows: Rows, index: np.ndarray) -> tuple[torch.Tensor, ...]:
        x = torch.from_numpy(rows[0][index])  # (B, T)
        y = torch.from_numpy(rows[1][index])  # (B, T)
        batch = (x, y) if self.document_bos is None else (x, y, document_ids_of(x, self.document_bos))
        return tuple(t.pin_memory() for t in batch) if self.pin_memory else batch

    def _train_stream(self):
        pool = np.arange(len(self.train_rows[0]))
        for b in itertools.count(self.start_batch):
            yield self._batch(self.train_rows, draw_rows(self.seed, self.rank, b, self.batch_size,
                                                         pool))

    def val_dataloader(self) -> list[tuple[torch.Tensor, ...]]:
        """This rank's share of the validation rows, in batches (every rank the same number)."""
        batches = rank_batches(np.arange(len(self.val_rows[0])), self.rank, self.world_size,
                               self.config.val_batch_size or self.batch_size, "row",
                               "hold out more conversations (data.val_fraction)")
        return [self._batch(self.val_rows, index) for index in batches]

    def bytes_per_token(self, tokenizer, budget: int) -> None:
        """None: the loss is masked (prompts train nothing), so it has no bits per byte."""

    def _settings(self) -> dict:
        return {"seed": self.seed, "batch_size": self.batch_size,
                "context_length": self.context_length, "train_rows": len(self.train_rows[0])}
