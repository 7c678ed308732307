"""Conversation records -> lists of messages, from local ``.jsonl`` files or a Hugging Face dataset.

A record is one JSON object in either of two forms:

- messages: ``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``;
- instruction (the book's instruction data): ``{"instruction": str, "input": str (optional),
  "output": str}``, read as a user turn (the instruction, then the input after a blank line when
  there is one) and an assistant turn (the output).

``read_jsonl`` returns ``(where, messages)`` pairs with ``where`` = ``path:line``; a record in neither
form, or a line that is not JSON, raises ``ChatDataError`` naming the file, the line and the
field. Messages' roles and contents are checked when they are rendered (``ChatTemplate``), whose
errors the caller prefixes with ``where``.
"""

from __future__ import annotations

from collections.abc import Iterator

from minigpt import files
from minigpt.data.config import DataError


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
        from minigpt.errors import first_line

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
