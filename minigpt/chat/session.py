"""A conversation with a chat model that keeps its KV cache across turns (docs/chat_cli.md).

Each turn feeds only what is new since the last one (the close of the previous reply and the new
messages up to the assistant's header) and samples the reply token by token, its text streamed
as soon as it is valid UTF-8 (``TextStream``). Greedy replies equal those of re-reading the
whole conversation with the uncached model (tests/chat/test_session.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from minigpt.errors import UserError
from minigpt.sampling import sample_next, validate_sampling

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}


class ContextFullError(UserError):
    """The next turn does not fit in the model's context; the message says how to go on."""


@dataclass
class Reply:
    """One assistant reply: its text, its token ids (without the end token) and why it stopped:
    ``end`` (the template's end token), ``length`` (``max_new_tokens``) or ``context``."""

    text: str
    ids: list[int]
    stopped: str


class TextStream:
    """Text of a growing token sequence, handed out as soon as it is complete: a BPE token can
    end inside a multi-byte character, whose text then waits for the next token. Each call
    decodes the tokens since the last text handed out and the piece before them (context for
    a tokenizer that spaces a token by its neighbour), not the whole sequence."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self._start = self._sent = 0  # ids[_start:_sent]: the piece before, already handed out

    def push(self, token: int) -> str:
        """Add a token; return the new complete text ("" while a character is unfinished)."""
        self.ids.append(token)
        text = self.decode(self.ids[self._start:])
        return "" if text.endswith("\ufffd") else self._new(text)

    def flush(self) -> str:
        """The rest of the text, an unfinished character included (as the replacement sign)."""
        return self._new(self.decode(self.ids[self._start:]))

    def _new(self, text: str) -> str:
        new = text[len(self.decode(self.ids[self._start:self._sent])):]
        self._start, self._sent = self._sent, len(self.ids)
        return new


class ChatSession:
    """Multi-turn chat with ``model`` (a ``GPT``, placed and in eval mode) through ``template``.

    ``temperature`` 0 is greedy; ``top_k``/``top_p``/``generator`` as ``sample_next`` takes them.
    ``autocast``: a function returning the context each forward pass runs in (None: the
    weights' dtype). ``messages`` is the conversation so far, replies included."""

    def __init__(self, model, tokenizer, template, *, max_new_tokens: int = 256,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 generator: torch.Generator | None = None,
                 autocast: Callable[[], contextlib.AbstractContextManager] | None = None):
        validate_sampling(temperature, top_k, top_p)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
        self.model, self.tokenizer, self.template = model, tokenizer, template
        self.max_new_tokens = max_new_tokens
        self.sample = dict(temperature=temperature, top_k=top_k, top_p=top_p,
                           generator=generator)
        self.autocast = autocast
        self.cache = model.new_kv_cache(1)
        self.allowed = self._allowed_tokens()
        self.messages: list[Message] = []
        self.pending: list[int] = []  # known tokens the model has not read yet

    @property
    def context_length(self) -> float:
        """The most tokens a conversation may hold (inf: a model that runs past its context)."""
        return float("inf") if self.model.unbounded else self.model.config.context_length

    @property
    def tokens_read(self) -> int:
        """Tokens of the conversation the model has read (in its KV cache)."""
        return self.cache.length

    def reset(self) -> None:
        """Start a new conversation (the cache's buffers are reused)."""
        self.cache.reset()
        self.messages, self.pending = [], []

    def say(self, text: str, on_text: Callable[[str], None] | None = None) -> Reply:
        """The user says ``text``; return the assistant's reply (``on_text``: its text as it
        comes). Raises ``ContextFullError`` (nothing changed) when the turn does not fit."""
        return self.ask([{"role": "user", "content": text}], on_text)

    def answer(self, messages: Sequence[Message],
               on_text: Callable[[str], None] | None = None) -> Reply:
        """A new conversation of ``messages``, read in one pass, and the assistant's reply."""
        self.reset()
        return self.ask(messages, on_text)

    def ask(self, messages: Sequence[Message],
            on_text: Callable[[str], None] | None = None) -> Reply:
        """Add ``messages`` to the conversation and sample the assistant's reply to them."""
        new = self.pending + self._new_turn_ids(list(messages))
        if self.tokens_read + len(new) > self.context_length:
            raise ContextFullError(
                f"context full: the conversation holds {self.tokens_read} of the model's "
                f"{self.context_length} tokens and this turn needs {len(new)} more; type /reset "
                "to start a new conversation")
        self.messages += messages
        reply = self._sample_reply(new, on_text)
        self._close_turn(reply)
        return reply

    def complete(self, ids: Sequence[int],
                 on_text: Callable[[str], None] | None = None) -> Reply:
        """The reply to a conversation already rendered to ``ids`` (ending with the assistant's
        header), read in one pass; the session is reset before and after."""
        self.reset()
        if len(ids) > self.context_length:
            raise ContextFullError(f"context full: the conversation has {len(ids)} tokens, "
                                   f"more than the model's {self.context_length}")
        try:
            return self._sample_reply(list(ids), on_text)
        finally:
            self.reset()

    def _sample_reply(self, new: list[int], on_text) -> Reply:
        """Read ``new``, then sample the reply token by token until ``end_id``,
        ``max_new_tokens`` or a full context."""
        stream = TextStream(self.tokenizer.decode)
        ids, stopped = [], "length"
        logits = self._read(new)
        while True:
            token = int(sample_next(logits + self.allowed, **self.sample)[0])
            self.pending = [token]  # sampled, not read yet
            if token == self.template.end_id:
                stopped = "end"
                break
            ids.append(token)
            if on_text is not None:
                on_text(stream.push(token))
            if len(ids) == self.max_new_tokens:
                break
            if self.tokens_read >= self.context_length:  # no room to read it
                stopped = "context"
                break
            logits = self._read([token])
        if on_text is not None:
            on_text(stream.flush())
        return Reply(self.tokenizer.decode(ids), ids, stopped)

    def _new_turn_ids(self, messages: list[Message]) -> list[int]:
        """The tokens ``messages`` add after the conversation so far, up to the assistant's
        header: the conversation rendered with them, less its rendering without them."""
        ids = list(self.template.prompt_ids(self.messages + messages))
        if not self.messages:
            return ids
        before = list(self.template.render(self.messages)[0])
        assert ids[:len(before)] == before, "a template renders a conversation turn by turn"
        return ids[len(before):]

    def _close_turn(self, reply: Reply) -> None:
        """Record the reply; what closes it in the rendered conversation (its end token, if it
        was cut, and whatever the template writes after it) waits in ``pending``."""
        message = {"role": "assistant", "content": reply.text}
        rendered = list(self.template.render(self.messages + [message])[0])
        end = len(rendered) - 1 - rendered[::-1].index(self.template.end_id)
        if reply.stopped != "end":
            self.pending.append(self.template.end_id)
        self.pending += rendered[end + 1:]
        self.messages.append(message)

    def _read(self, ids: list[int]) -> torch.Tensor:
        """Feed ``ids`` through the model into the cache; the next token's logits (1, V)."""
        device = self.cache.seen.device
        idx = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
        with torch.inference_mode(), \
                self.autocast() if self.autocast is not None else contextlib.nullcontext():
            return self.model(idx, kv_cache=self.cache, last_only=True)[:, -1].float()

    def _allowed_tokens(self) -> torch.Tensor:
        """A (V,) additive mask: 0 for the tokenizer's text tokens and the end token, -inf for
        the rest (end-of-text, a model's padded rows and the template's other special tokens
        are never sampled: a reply is text)."""
        allowed = torch.full((self.model.config.vocab_size,), float("-inf"),
                             device=self.cache.seen.device)
        allowed[:self.tokenizer.vocab_size] = 0
        allowed[self.tokenizer.eot_id] = float("-inf")
        allowed[self.template.end_id] = 0
        return allowed
