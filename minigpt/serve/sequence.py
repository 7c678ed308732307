"""One sequence the engine decodes (a completion's choice, a chat reply): what it asked for, its
tokens so far, and the text it may send.

The engine thread calls ``accept`` with each sampled token; the sequence decides whether it is
finished (an end token, a stop string, ``max_tokens``) and hands ``Event`` objects to its
``sink`` (the request's consumer, in another thread: the sink must be thread-safe). Text goes
out only at complete UTF-8 characters, and never a piece that could begin a stop string.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from minigpt.chat.session import TextStream


@dataclass
class SamplingParams:
    """What a request asks of its sequence (validated by the protocol layer)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # top alternatives listed per token; None: no logprobs
    echo: bool = False  # the prompt's tokens come first (with logprobs: scored)


@dataclass
class TokenLogprob:
    """A token's text, its log-probability under the model (None: the first prompt token) and
    the most likely alternatives ``{text: logprob}``."""

    text: str
    logprob: float | None
    top: dict[str, float] | None


@dataclass
class Event:
    """Part of a sequence's output: new text, the tokens behind it (with their logprobs when
    asked), and, on the last one, why it ended (``stop``, ``length``, ``cancelled``)."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


def merge_events(events: list[Event]) -> list[Event]:
    """``events`` with each run of one sequence's consecutive events merged into one (text and
    logprobs joined; the last one's end)."""
    merged: list[Event] = []
    for event in events:
        last = merged[-1] if merged else None
        if last is None or last.index != event.index or last.finish_reason is not None:
            merged.append(replace(event, logprobs=list(event.logprobs)))  # the engine's unchanged
            continue
        last.text += event.text
        last.logprobs += event.logprobs
        last.finish_reason = event.finish_reason
        last.prompt_tokens, last.completion_tokens = event.prompt_tokens, event.completion_tokens
    return merged


class StopText:
    """Text held back while it could be the start of one of ``stops``."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return the text that may go out and whether a stop string ended it
        (the stop string and anything after it are dropped)."""
        self.pending += text
        found = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if found:
            out, self.pending = self.pending[:min(found)], ""
            return out, True
        hold = max((n for s in self.stops for n in range(1, len(s))
                    if self.pending.endswith(s[:n])), default=0)
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(out):]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Sequence:
    """A prompt and its continuation as the engine decodes it (see the module docstring).

    ``end_ids``: tokens that end it (not part of its text); ``allowed``: a (V,) additive mask
    of the tokens it may sample (0 or -inf); ``decode``: the tokenizer's; ``index``: its choice
    number in the response."""

    def __init__(self, prompt: list[int], params: SamplingParams, *, end_ids: set[int],
                 allowed: torch.Tensor, decode: Callable[[list[int]], str],
                 sink: Callable[[Event], None], index: int = 0):
        self.prompt, self.params, self.end_ids = list(prompt), params, end_ids
        self.allowed, self.decode, self.sink, self.index = allowed, decode, sink, index
        self.tokens: list[int] = []
        self.text = TextStream(decode)
        self.stop = StopText(params.stop)
        self.cancelled = False  # set by the consumer (a disconnect): the engine drops it
        self.finished = False
        self.generator = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=allowed.device)
            if params.seed is not None:
                self.generator.manual_seed(params.seed + index)
            else:
                self.generator.seed()

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0

    def cancel(self) -> None:
        """Called by the consumer: the engine drops the sequence at its next step."""
        self.cancelled = True

    def start(self, prompt_logprobs: list[TokenLogprob] | None) -> None:
        """The prompt was read: send its echo (and scores), or finish at once for
        ``max_tokens`` 0."""
        event = Event(self.index)
        if self.params.echo:
            event.text = self.decode(self.prompt)
            event.logprobs = prompt_logprobs or []
        if self.params.max_tokens == 0:
            self._finish(event, "length")
        elif event.text or event.logprobs:
            self.sink(event)

    def accept(self, token: int, logprob: TokenLogprob | None) -> bool:
        """Take the sampled ``token``; send what it adds; return whether the sequence is
        finished."""
        event = Event(self.index, logprobs=[logprob] if logprob is not None else [])
        if token in self.end_ids:
            event.text = self.stop.push(self.text.flush())[0] + self.stop.flush()
            event.logprobs = []
            self._finish(event, "stop")
            return True
        self.tokens.append(token)
        text, stopped = self.stop.push(self.text.push(token))
        event.text = text
        if stopped:
            self._finish(event, "stop")
        elif len(self.tokens) == self.params.max_tokens:
            rest, stopped = self.stop.push(self.text.flush())
            event.text += rest + ("" if stopped else self.stop.flush())
            self._finish(event, "stop" if stopped else "length")
        elif event.text or event.logprobs:
            self.sink(event)
        return self.finished

    def abort(self, reason: str = "cancelled") -> None:
        """End it without more tokens (a cancel, or the server shutting down)."""
        if not self.finished:
            self._finish(Event(self.index), reason)

    def _finish(self, event: Event, reason: str) -> None:
        self.finished = True
        event.finish_reason = reason
        event.prompt_tokens, event.completion_tokens = len(self.prompt), len(self.tokens)
        self.sink(event)


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, top: int,
                   decode: Callable[[list[int]], str]) -> list[TokenLogprob]:
    """For rows of ``logits`` (N, V) and the token each chose (N,): its log-probability under
    the model's whole vocabulary and the ``top`` most likely tokens."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
    picked = logp.gather(1, chosen[:, None])[:, 0].tolist()
    best = logp.topk(top, dim=-1) if top > 0 else None
    out = []
    for n, token in enumerate(chosen.tolist()):
        alternatives = None
        if best is not None:
            alternatives = {}
            for value, i in zip(best.values[n].tolist(), best.indices[n].tolist(), strict=True):
                alternatives.setdefault(decode([i]), value)
        value = picked[n]
        out.append(TokenLogprob(decode([token]), value if math.isfinite(value) else -9999.0,
                                alternatives))
    return out
