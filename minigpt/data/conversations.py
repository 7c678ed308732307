"""Conversations for fine-tuning: records read from ``.jsonl`` files or a Hugging Face dataset,
and rendered conversations packed into training rows.

Records. One JSON object in either of two forms:

- messages: ``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``;
- instruction (the book's instruction data): ``{"instruction": str, "input": str (optional),
  "output": str}``, read as a user turn (the instruction, then the input after a blank line when
  there is one) and an assistant turn (the output).

``read_jsonl`` returns ``(where, messages)`` pairs with ``where`` = ``path:line``; a record in neither
form, or a line that is not JSON, raises ``ChatDataError`` naming the file, the line and the
field. Messages' roles and contents are checked when they are rendered (``ChatTemplate``), whose
errors the caller prefixes with ``where``.

Rows. Letters: N rows, T = context_length. A rendered conversation is ``(ids, train_mask)`` from
``ChatTemplate.render``: BOS first, ``train_mask[i]`` True where token ``i`` is trained on. A row
holds T + 1 tokens: whole conversations one after another (``packed``) or one each (``padded``),
then padding (the BOS id) to T + 1. ``x = row[:-1]``; ``y = row[1:]`` where the mask is True and
``IGNORE_INDEX`` elsewhere (the loss's ``ignore_index``: prompts, role headers, padding and the
BOS that starts the next conversation train nothing). Every row starts at a BOS, so with
``document_mask`` each conversation attends only to itself (``minigpt.documents``). A
conversation longer than T + 1 tokens is dropped or truncated to its first T + 1 tokens
(``too_long``); one with no trained token left is dropped, never cut silently. ``PackReport``
counts both for the one line a run prints.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from minigpt import files
from minigpt.data.config import DataError
from minigpt.errors import first_line
from minigpt.model import IGNORE_INDEX

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
    """``(x, y, report)``: int64 (N, T) inputs and targets (see the module docstring); packing
    keeps the conversations' order, starting a new row when the next one does not fit."""
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
    """The messages of a record in either form (see the module docstring); ``ValueError``
    naming the field otherwise."""
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
    return files.read_jsonl(path, lambda record, where: (where, checked(where, record)),
                            ChatDataError)


def read_hub(name: str, config: str | None, split: str, revision: str | None,
             cache_dir: str | None) -> Iterator[tuple[str, list[dict]]]:
    """``(dataset 'name' row i, messages)`` of each row of a Hugging Face dataset in either form."""
    import datasets

    try:
        rows = datasets.load_dataset(name, config, split=split, revision=revision,
                                     cache_dir=cache_dir)
    except Exception as e:  # network, missing dataset or split: one line either way
        raise ChatDataError(f"cannot load dataset {name!r} (config {config!r}, split {split!r}): "
                            f"{first_line(e, root_cause=True)}; hub datasets need network "
                            "access, or use local .jsonl files in data.paths") from None
    for i, record in enumerate(rows):
        where = f"dataset {name!r} row {i}"
        yield where, checked(where, record)


def checked(where: str, record) -> list[dict]:
    """``conversation_of(record)`` with its error prefixed by ``where``."""
    try:
        return conversation_of(record)
    except ValueError as e:
        raise ChatDataError(f"{where}: {e}") from None
