"""The chat template: a conversation -> token ids, and which of them the loss trains on.

A conversation is a list of ``{"role": "system" | "user" | "assistant", "content": str}``,
rendered ``BOS <|user|> content <|end|> <|assistant|> content <|end|> ...``: BOS is the
tokenizer's end-of-text, the four special tokens take the ids after the tokenizer's own, and
content is ordinary text (docs/chat.md). Bad messages raise ``ChatFormatError`` naming the message
and the field.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from minigpt.errors import UserError

ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
FORMAT = "minigpt-chat-1"  # the to_dict() layout; raise it when the rendering changes
METADATA_KEY = "chat_template"  # its key in a checkpoint's metadata


class ChatFormatError(UserError, ValueError):
    """A message or stored template that is not in the expected form; the message says which."""


class ChatTemplate:
    """Renders conversations for one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer, special_ids: dict[str, int], bos_id: int):
        if sorted(special_ids) != sorted(SPECIAL_TOKENS):
            raise ChatFormatError(f"a chat template needs ids for {', '.join(SPECIAL_TOKENS)}, "
                                  f"got {sorted(special_ids)}")
        self.tokenizer, self.bos_id = tokenizer, int(bos_id)
        self.special_ids = {text: int(i) for text, i in special_ids.items()}
        self.role_ids = {role: self.special_ids[f"<|{role}|>"] for role in ROLES}
        self.assistant_id = self.role_ids["assistant"]
        self.end_id = self.special_ids["<|end|>"]
        self._text_of = {i: text for text, i in self.special_ids.items()}

    @classmethod
    def for_tokenizer(cls, tokenizer) -> ChatTemplate:
        """The special tokens after the tokenizer's last id; BOS is its end-of-text."""
        first = tokenizer.vocab_size
        return cls(tokenizer, {t: first + i for i, t in enumerate(SPECIAL_TOKENS)},
                   tokenizer.eot_id)

    @property
    def min_vocab_size(self) -> int:
        """The fewest embedding rows a model needs to read and write these ids."""
        return max(self.tokenizer.vocab_size, *self.special_ids.values()) + 1

    def to_dict(self) -> dict:
        """Plain JSON types, for a checkpoint's metadata."""
        return {"format": FORMAT, "special_ids": dict(self.special_ids), "bos_id": self.bos_id}

    @classmethod
    def from_dict(cls, d: dict, tokenizer) -> ChatTemplate:
        """The template ``to_dict`` stored, for ``tokenizer`` (the checkpoint's)."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            found = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise ChatFormatError(f"stored chat template has format {found!r}; this minigpt "
                                  f"reads {FORMAT!r}")
        return cls(tokenizer, d["special_ids"], d["bos_id"])

    # ---- rendering ------------------------------------------------------------------------
    def message_ids(self, message: dict, index: int = 0) -> list[int]:
        """``<|role|> content <|end|>`` of one message (``index`` names it in errors). A KV cache
        kept across turns relies on ``prompt_ids(h + [reply, user]) == prompt_ids(h) + reply_ids
        + [end_id] + message_ids(user) + [assistant_id]``."""
        role, content = check_message(message, index)
        try:
            text_ids = self.tokenizer.encode(content)
        except ValueError as e:  # the character tokenizer: characters it has never seen
            raise ChatFormatError(f"message {index} field 'content': {e}") from None
        return [self.role_ids[role], *text_ids, self.end_id]

    def render(self, messages: Sequence[dict]) -> tuple[list[int], list[bool]]:
        """``(ids, train_mask)`` of a whole conversation, BOS first; ``train_mask`` is True on
        each assistant message's content and its ``<|end|>``."""
        check_conversation(messages)
        ids, mask = [self.bos_id], [False]
        for i, message in enumerate(messages):
            part = self.message_ids(message, i)
            trains = message["role"] == "assistant"
            ids += part
            mask += [False] + [trains] * (len(part) - 1)  # the role token is never a target
        return ids, mask

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """The history rendered, then ``<|assistant|>``: generate from here, stop at ``end_id``."""
        ids = [self.bos_id]
        for i, message in enumerate(messages):
            ids += self.message_ids(message, i)
        return ids + [self.assistant_id]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, special tokens (and BOS, as end-of-text) written as their text."""
        parts, run = [], []
        for i in map(int, ids):
            if i in self._text_of:
                parts.append(self.tokenizer.decode(run))
                parts.append(self._text_of[i])
                run = []
            else:
                run.append(i)
        return "".join(parts) + self.tokenizer.decode(run)


def check_message(message, index: int = 0) -> tuple[str, str]:
    """``(role, content)`` of a message, or ``ChatFormatError`` naming ``index`` and the field."""
    if not isinstance(message, dict):
        raise ChatFormatError(f"message {index} is a {type(message).__name__}, not an object "
                              "with 'role' and 'content'")
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
        raise ChatFormatError(f"message {index} field 'role' is {role!r}; use one of "
                              f"{', '.join(ROLES)}")
    if not isinstance(content, str):
        raise ChatFormatError(f"message {index} field 'content' is "
                              f"{type(content).__name__}, not a string")
    return role, content


def check_conversation(messages) -> None:
    """A non-empty list of messages."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatFormatError("field 'messages' must be a non-empty list of messages")


def read_chat_template(meta: dict, tokenizer) -> ChatTemplate | None:
    """The template a checkpoint's metadata stores (``METADATA_KEY``), or None (a base model)."""
    stored = meta.get(METADATA_KEY)
    return None if stored is None else ChatTemplate.from_dict(stored, tokenizer)
