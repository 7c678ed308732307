"""``data.source=chat``: conversations (``.jsonl`` files or a Hugging Face dataset) to fine-tune on.

Conversations are few and short next to a pretraining corpus, so they are read, rendered with
the chat template and packed in memory when the run starts (``minigpt.chat.setup``,
``minigpt.chat.datamodule``); nothing is prepared on disk. ``DataConfig``'s ``paths``,
``hub_name``, ``hub_config``, ``split``, ``revision``, ``val_fraction``, ``max_documents``,
``batch_size`` and ``val_batch_size`` apply; the settings of its own sit in
``data.source_args`` (``ChatSettings``; ``configs/data/chat.yaml`` lists them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from minigpt.chat.rows import ROW_MODES, TOO_LONG, TRAIN_ON
from minigpt.data.config import DataError
from minigpt.paths import INPUT_GLOBS, path_field


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
        problems = [f"unknown data.source_args.{k} (known: {', '.join(sorted(known))})"
                    for k in sorted(set(args) - known)]
        settings = cls(**{k: v for k, v in args.items() if k in known})
        for name, allowed in (("train_on", TRAIN_ON), ("rows", ROW_MODES),
                              ("too_long", TOO_LONG)):
            value = getattr(settings, name)
            if value not in allowed:
                problems.append(f"data.source_args.{name}={value!r} must be one of "
                                f"{', '.join(allowed)}")
        if isinstance(settings.val_paths, str):
            settings.val_paths = [settings.val_paths]
        if problems:
            raise DataError("bad chat data config: " + "; ".join(problems))
        return settings
