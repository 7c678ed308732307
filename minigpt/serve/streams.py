"""The engine's events as OpenAI responses: a whole response, or one streamed chunk per event.

``CompletionOutput`` writes ``text_completion`` objects (``logprobs``: tokens, token_logprobs,
top_logprobs, text_offset); ``ChatOutput`` writes ``chat.completion`` objects and their
``chat.completion.chunk`` deltas. Both count usage: a prompt once per prompt (not per choice),
every choice's new tokens.
"""

from __future__ import annotations

import time
import uuid

from minigpt.serve.sequence import Event, TokenLogprob


class _Output:
    object_name = ""
    chunk_name = ""

    def __init__(self, model: str, n: int):
        self.model, self.n = model, n
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.choices: dict[int, dict] = {}
        self.prompt_tokens = self.completion_tokens = 0
        self.failed = False

    id_prefix = "cmpl"

    def add(self, event: Event) -> None:
        choice = self.choices.setdefault(event.index, self.new_choice(event.index))
        self.extend(choice, event)
        if event.finish_reason is not None:
            choice["finish_reason"] = event.finish_reason
            self.failed |= event.finish_reason == "error"
            self.completion_tokens += event.completion_tokens
            if event.index % self.n == 0:
                self.prompt_tokens += event.prompt_tokens

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def response(self) -> dict:
        return {"id": self.id, "object": self.object_name, "created": self.created,
                "model": self.model, "choices": [self.choices[i] for i in sorted(self.choices)],
                "usage": self.usage()}

    def opening(self) -> list[dict]:
        return []

    def usage_chunk(self) -> dict:
        return {**self._chunk_head(), "choices": [], "usage": self.usage()}

    def _chunk_head(self) -> dict:
        return {"id": self.id, "object": self.chunk_name, "created": self.created,
                "model": self.model}

    def new_choice(self, index: int) -> dict:
        raise NotImplementedError

    def extend(self, choice: dict, event: Event) -> None:
        raise NotImplementedError


class CompletionOutput(_Output):
    """``/v1/completions``: ``n`` choices per prompt; ``echo``, ``logprobs`` as asked."""

    object_name = chunk_name = "text_completion"

    def __init__(self, model: str, n: int = 1, *, echo: bool = False, logprobs: bool = False):
        super().__init__(model, n)
        self.logprobs = logprobs
        self.offsets: dict[int, int] = {}

    def new_choice(self, index: int) -> dict:
        return {"index": index, "text": "", "logprobs": self._new_logprobs(),
                "finish_reason": None}

    def _new_logprobs(self) -> dict | None:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []} \
            if self.logprobs else None

    def extend(self, choice: dict, event: Event) -> None:
        choice["text"] += event.text
        if choice["logprobs"] is not None:
            self._add_logprobs(choice["logprobs"], event)

    def _add_logprobs(self, into: dict, event: Event) -> None:
        offset = self.offsets.get(event.index, 0)
        for entry in event.logprobs:
            into["tokens"].append(entry.text)
            into["token_logprobs"].append(entry.logprob)
            into["top_logprobs"].append(entry.top)
            into["text_offset"].append(offset)
            offset += len(entry.text)
        self.offsets[event.index] = offset

    def chunk(self, event: Event) -> dict | None:
        if not event.text and not event.logprobs and event.finish_reason is None:
            return None
        logprobs = self._new_logprobs()
        if logprobs is not None:
            self._add_logprobs(logprobs, event)
        return {**self._chunk_head(), "choices": [{
            "index": event.index, "text": event.text, "logprobs": logprobs,
            "finish_reason": event.finish_reason}]}


class ChatOutput(_Output):
    """``/v1/chat/completions``: ``n`` replies; ``logprobs`` as asked."""

    object_name, chunk_name, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(self, model: str, n: int = 1, *, logprobs: bool = False):
        super().__init__(model, n)
        self.logprobs = logprobs

    def new_choice(self, index: int) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": ""},
                "logprobs": {"content": []} if self.logprobs else None, "finish_reason": None}

    def extend(self, choice: dict, event: Event) -> None:
        choice["message"]["content"] += event.text
        if choice["logprobs"] is not None:
            choice["logprobs"]["content"] += [_chat_logprob(e) for e in event.logprobs]

    def opening(self) -> list[dict]:
        return [{**self._chunk_head(), "choices": [{
            "index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}]} for i in range(self.n)]

    def chunk(self, event: Event) -> dict | None:
        if not event.text and not event.logprobs and event.finish_reason is None:
            return None
        logprobs = {"content": [_chat_logprob(e) for e in event.logprobs]} \
            if self.logprobs else None
        delta = {"content": event.text} if event.text else {}
        return {**self._chunk_head(), "choices": [{
            "index": event.index, "delta": delta, "logprobs": logprobs,
            "finish_reason": event.finish_reason}]}


def _chat_logprob(entry: TokenLogprob) -> dict:
    return {"token": entry.text, "logprob": entry.logprob, "bytes": list(entry.text.encode()),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                             for t, v in (entry.top or {}).items()]}
