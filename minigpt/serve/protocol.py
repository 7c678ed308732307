"""The OpenAI protocol's request bodies (pydantic models) and its error shape.

Fields a client may send that this server has no use for (``user``, ``logit_bias`` {} ...) are
ignored, as OpenAI's servers ignore unknown fields; a value this server cannot honour (a
penalty, ``best_of`` > ``n``) is refused with a 400 naming it. Types are strict: ``"5"`` is not
a number. ``top_k`` is an extension (vLLM's name).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = StrictInt | StrictFloat
TokenIds = list[StrictInt]


class APIError(Exception):
    """An error response: HTTP ``status`` and OpenAI's ``{"error": {message, type, param,
    code}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: StrictStr | None = None
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None  # -1 or 0: no limit (vLLM's)
    n: Annotated[StrictInt, Field(ge=1, le=16)] = 1
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=4)] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None

    def unsupported(self) -> list[str]:
        """The fields set to something this server does not do."""
        return [f"{name}={value!r} (only 0 is supported)" for name, value in
                (("presence_penalty", self.presence_penalty),
                 ("frequency_penalty", self.frequency_penalty)) if value not in (None, 0)]

    def stops(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) \
            else tuple(self.stop)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token
    ids, or a list of lists of token ids."""

    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    best_of: StrictInt | None = None

    def unsupported(self) -> list[str]:
        problems = super().unsupported()
        if self.best_of not in (None, self.n):
            problems.append(f"best_of={self.best_of!r} (only best_of=n is supported)")
        return problems


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: StrictStr
    content: StrictStr | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else \
            "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's, which lm-eval's remote tokenizer reads)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    prompt: StrictStr
    add_special_tokens: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    tokens: TokenIds
