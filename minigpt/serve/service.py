"""What a request becomes: prompts as token ids, checked against the model and the server's
limits, and the ``Sequence`` objects the engine decodes (one per prompt and choice).

Completions continue text as ``generate.py`` does: an empty prompt starts from the end-of-text
token, the end-of-text token ends a sequence, and only the tokenizer's ids are sampled. Chat
completions render the messages with the model's stored chat template
(``minigpt.chat.template``) and sample text tokens until its end token, as ``generate.py
chat=true`` does; a base model without a template is refused.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minigpt.chat.template import ChatFormatError
from minigpt.serve.engine import Engine
from minigpt.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from minigpt.serve.sequence import Event, SamplingParams, Sequence

Sink = Callable[[Event], None]


class Service:
    """One served model: its ``config`` (a ``GPTConfig``), ``tokenizer`` and chat ``template``
    (None: a base model), the ``name`` clients see, and the ``engine`` that decodes it (an
    ``Engine``, or an ``EngineProcess`` running one); ``max_tokens`` caps what one request may
    ask for; ``device``: the engine's, where the sequences' token masks live."""

    def __init__(self, config, tokenizer, engine: Engine, *, name: str,
                 template=None, max_tokens: int = 4096, device: str = "cpu"):
        self.config, self.tokenizer, self.engine = config, tokenizer, engine
        self.name, self.template, self.max_tokens = name, template, max_tokens
        self.context_length = config.context_length
        V = config.vocab_size
        self.text_tokens = torch.full((V,), float("-inf"), device=device)
        self.text_tokens[:tokenizer.vocab_size] = 0
        self.chat_tokens = None
        self.specials = {} if template is None else \
            {i: text for text, i in template.special_ids.items()}
        if template is not None:  # text and the end token: a reply is text (ChatSession's rule)
            self.chat_tokens = self.text_tokens.clone()
            self.chat_tokens[tokenizer.eot_id] = float("-inf")
            self.chat_tokens[template.end_id] = 0

    def describe(self) -> dict:
        """``/v1/models``' entry, with ``context_length`` and ``chat`` as extensions."""
        return {"id": self.name, "object": "model", "created": 0, "owned_by": "minigpt",
                "context_length": self.context_length, "chat": self.template is not None}

    def completion_sequences(self, request: CompletionRequest, sink: Sink) -> list[Sequence]:
        prompts = self._completion_prompts(request.prompt)
        params = self._params(request, default_max=16, prompt_tokens=max(map(len, prompts)))
        params.logprobs, params.echo = request.logprobs, request.echo
        return [Sequence(prompt, params, end_ids={self.tokenizer.eot_id},
                         allowed=self.text_tokens, decode=self.decode, sink=sink,
                         index=p * request.n + j)
                for p, prompt in enumerate(prompts) for j in range(request.n)]

    def chat_sequences(self, request: ChatCompletionRequest, sink: Sink) -> list[Sequence]:
        if self.template is None:
            raise APIError(400, f"model {self.name!r} is a base model without a chat template: "
                           "use /v1/completions, or serve a model fine-tuned with "
                           "experiment=sft", param="messages", code="no_chat_template")
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        try:
            prompt = list(self.template.prompt_ids(messages))
        except ChatFormatError as e:
            raise APIError(400, str(e), param="messages") from None
        if request.max_completion_tokens is not None:
            request.max_tokens = request.max_completion_tokens
        params = self._params(request, default_max=None, prompt_tokens=len(prompt))
        if request.logprobs:
            params.logprobs = request.top_logprobs or 0
        return [Sequence(prompt, params, end_ids={self.template.end_id},
                         allowed=self.chat_tokens, decode=self.decode, sink=sink,
                         index=j) for j in range(request.n)]

    def _completion_prompts(self, prompt) -> list[list[int]]:
        """Token ids of each prompt; an empty one starts a new document (end of text)."""
        if isinstance(prompt, str):
            prompts = [self.encode(prompt)]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        else:
            prompts = [self.encode(p) if isinstance(p, str) else list(p) for p in prompt]
        if not prompts:
            raise APIError(400, "prompt is an empty list: give a string, a list of strings or "
                           "token ids", param="prompt")
        for p in prompts:
            self.check_ids(p, "prompt")
        return [p or [self.tokenizer.eot_id] for p in prompts]

    def decode(self, ids: list[int]) -> str:
        """Text of any of the model's ids: the tokenizer's own, a chat template's special
        tokens as their text, any other id (a padded vocabulary row) as ``<|id|>``."""
        text, run = [], []
        for i in ids:
            if i < self.tokenizer.vocab_size:
                run.append(i)
                continue
            if run:
                text.append(self.tokenizer.decode(run))
                run = []
            text.append(self.specials.get(i, f"<|{i}|>"))
        if run:
            text.append(self.tokenizer.decode(run))
        return "".join(text)

    def check_ids(self, ids: list[int], param: str) -> None:
        V = self.config.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise APIError(400, f"{param}: token id {bad[0]} is outside the model's vocabulary "
                           f"[0, {V})", param=param)

    def encode(self, text: str) -> list[int]:
        """The text's ids (a character the tokenizer lacks: a 400)."""
        try:
            return self.tokenizer.encode(text)
        except ValueError as e:  # the character tokenizer names a character it lacks
            raise APIError(400, f"prompt: {e}", param="prompt") from None

    def _params(self, request: SamplingFields, *, default_max: int | None,
                prompt_tokens: int) -> SamplingParams:
        """The sampling values, checked: the server's caps and the context (prompt + new
        tokens <= context_length)."""
        unsupported = request.unsupported()
        if unsupported:
            raise APIError(400, "not supported: " + "; ".join(unsupported),
                           param=unsupported[0].split("=")[0])
        room = self.context_length - prompt_tokens
        max_tokens = request.max_tokens
        if max_tokens is not None and max_tokens > self.max_tokens:
            raise APIError(400, f"max_tokens={max_tokens} is more than this server allows "
                           f"({self.max_tokens}); ask for fewer", param="max_tokens")
        if max_tokens is None:
            max_tokens = default_max if default_max is not None else min(room, self.max_tokens)
        if max_tokens > room or max_tokens == 0 and default_max is None:
            raise APIError(400, f"this model's context is {self.context_length} tokens, but the "
                           f"prompt has {prompt_tokens} and max_tokens is {max_tokens}: "
                           "shorten the prompt or lower max_tokens", param="max_tokens"
                           if room > 0 else "prompt", code="context_length_exceeded")
        top_k = request.top_k if request.top_k not in (None, -1, 0) else None
        top_p = request.top_p if request.top_p not in (None, 1) else None
        temperature = 1.0 if request.temperature is None else float(request.temperature)
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                              top_p=top_p, seed=request.seed, stop=request.stops())
