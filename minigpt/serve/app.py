"""The HTTP side: ``create_app(service, ...)`` -> a FastAPI app speaking the OpenAI protocol.

Routes: ``GET /`` (the chat page, ``static/index.html``), ``GET /health``, ``GET /metrics`` (the
engine's counts in Prometheus' text format), ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true``: server-sent events,
``data: <json>`` per chunk then ``data: [DONE]``), and vLLM's ``/tokenize``, ``/detokenize``
and ``/tokenizer_info``, which lm-eval's ``local-completions`` reads to tokenize as the server
does. Every error is OpenAI's JSON shape with its status (``protocol.APIError``); a malformed
or mistyped body is a 400. A request whose client goes away is cancelled: its rows leave the
batch at the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from minigpt.serve.engine import Engine, QueueFull
from minigpt.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from minigpt.serve.sequence import Event, Sequence, merge_events
from minigpt.serve.service import Service
from minigpt.serve.streams import ChatOutput, CompletionOutput

PAGE = Path(__file__).parent / "static" / "index.html"
DISCONNECT_POLL_S = 0.5
# GET /metrics: each of the engine's counts (``EngineStats`` field or engine property), its
# Prometheus type and help text
METRICS = (
    ("running", "gauge", "Sequences decoding in the running batch."),
    ("waiting", "gauge", "Sequences queued for a place in the batch."),
    ("prompt_tokens", "counter", "Prompt tokens read."),
    ("generated_tokens", "counter", "Tokens sampled (each sequence's end token included)."),
    ("decode_steps", "counter", "Decode steps (one token for every running sequence)."),
    ("decode_step_rows", "counter", "Rows decoded, summed over the steps."),
    ("largest_batch", "gauge", "The most rows one decode step has held."),
    ("cancelled", "counter", "Sequences dropped because their client went away."),
    ("prefill_seconds", "counter", "Engine seconds reading prompts (first tokens and joins "
     "included)."),
    ("decode_forward_seconds", "counter", "Engine seconds in decode steps' forward passes (on a "
     "GPU: launching them)."),
    ("decode_sampling_seconds", "counter", "Engine seconds sampling decode steps' tokens (on a "
     "GPU: waiting for the step too)."),
)


def create_app(service: Service, *, api_key: str | None = None,
               max_body_bytes: int = 1_000_000, stream_interval: float = 0.0) -> FastAPI:
    """The app serving ``service`` (its engine started by the caller). ``api_key``: required
    as ``Authorization: Bearer <key>`` on every route but ``/`` and ``/health``;
    ``stream_interval``: see ``EventPipe``."""
    app = FastAPI(title="minigpt", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    _add_error_handlers(app)
    authorized = Depends(_key_check(api_key))

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(PAGE, media_type="text/html")

    @app.get("/health")
    async def health():
        """200 while the engine decodes; 503 once it failed (a load balancer stops sending)."""
        counts, failed = service.engine.counts(), service.engine.error is not None
        body = {"status": "failed" if failed else "ok", "running": counts["running"],
                "waiting": counts["waiting"]}
        return JSONResponse(body, status_code=503 if failed else 200)

    @app.get("/metrics", dependencies=[authorized])
    async def metrics():
        return PlainTextResponse(metrics_text(service.engine),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[authorized])
    async def models():
        return {"object": "list", "data": [service.describe()]}

    @app.post("/v1/completions", dependencies=[authorized])
    async def completions(body: CompletionRequest, request: Request):
        pipe, sequences = _submit(service, lambda sink: service.completion_sequences(body, sink),
                                  stream_interval)
        output = CompletionOutput(service.name, body.n, echo=body.echo,
                                  logprobs=body.logprobs is not None)
        return await _respond(service.engine, request, pipe, sequences, output, body.stream,
                              body.stream_options is not None and body.stream_options.include_usage)

    @app.post("/v1/chat/completions", dependencies=[authorized])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        pipe, sequences = _submit(service, lambda sink: service.chat_sequences(body, sink),
                                  stream_interval)
        output = ChatOutput(service.name, body.n, logprobs=body.logprobs)
        return await _respond(service.engine, request, pipe, sequences, output, body.stream,
                              body.stream_options is not None and body.stream_options.include_usage)

    @app.get("/tokenizer_info", dependencies=[authorized])
    async def tokenizer_info():
        tokenizer = service.tokenizer
        eos = tokenizer.decode([tokenizer.eot_id])
        return {"tokenizer_class": type(tokenizer).__name__, "name": tokenizer.name,
                "eos_token": eos, "bos_token": None, "pad_token": None,
                "model_max_length": service.context_length}

    @app.post("/tokenize", dependencies=[authorized])
    async def tokenize(body: TokenizeRequest):
        tokenizer = service.tokenizer
        # the end-of-text token's own text alone is that token: lm-eval's remote tokenizer
        # finds the end-of-text id by encoding its text
        tokens = [tokenizer.eot_id] if body.prompt == tokenizer.decode([tokenizer.eot_id]) \
            else service.encode(body.prompt)
        return {"tokens": tokens, "count": len(tokens),
                "max_model_len": service.context_length}

    @app.post("/detokenize", dependencies=[authorized])
    async def detokenize(body: DetokenizeRequest):
        service.check_ids(body.tokens, "tokens")
        return {"prompt": service.tokenizer.decode(body.tokens)}

    return app


class EventPipe:
    """A request's events, from the engine's thread (``put``) to the event loop (``get``).

    The event loop is woken for a sequence's first event and its last at once, and for the
    others at most every ``interval`` seconds, with all that arrived since: each wake-up and
    each write costs the engine's thread the interpreter lock, so streaming several tokens an
    event frees it for decoding. ``interval`` 0: every event wakes it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float):
        self.loop, self.interval = loop, interval
        self._lock = threading.Lock()
        self._events: list[Event] = []
        self._started: set[int] = set()  # indices that sent their first event
        self._woken_at = -float("inf")
        self._waking = False  # a wake-up is scheduled and not yet collected
        self._ready = asyncio.Event()

    def put(self, event: Event) -> None:  # the engine's thread
        now = time.monotonic()
        with self._lock:
            self._events.append(event)
            urgent = event.finish_reason is not None or event.index not in self._started
            self._started.add(event.index)
            if self._waking or not urgent and now - self._woken_at < self.interval:
                return
            self._waking, self._woken_at = True, now
        try:
            self.loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:  # the event loop is closed (shut down): no one is listening
            pass

    async def get(self) -> list[Event]:
        """The events that arrived since the last call (waits for at least one)."""
        while True:
            with self._lock:
                events, self._events, self._waking = self._events, [], False
            if events:
                return events
            self._ready.clear()
            await self._ready.wait()


def _submit(service: Service, make, interval: float) -> tuple[EventPipe, list[Sequence]]:
    """The request's sequences, queued in the engine; their events arrive through the pipe."""
    pipe = EventPipe(asyncio.get_running_loop(), interval)
    sequences = make(pipe.put)
    try:
        service.engine.submit(sequences)
    except QueueFull as e:
        raise APIError(429, f"the server is busy: {e}; retry shortly", type="rate_limit_error",
                       code="queue_full", headers={"Retry-After": "1"}) from None
    except RuntimeError as e:
        reason = "its engine failed: restart it" if service.engine.error is not None \
            else f"it is shutting down ({e})"
        raise APIError(503, f"the server cannot decode: {reason}", type="server_error",
                       code="unavailable") from None
    return pipe, sequences


async def _respond(engine: Engine, request: Request, pipe: EventPipe, sequences: list[Sequence],
                   output, stream: bool, include_usage: bool):
    if stream:
        return StreamingResponse(_stream(engine, pipe, sequences, output, include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        unfinished = len(sequences)
        while unfinished:
            try:
                events = await asyncio.wait_for(pipe.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return None
                continue
            for event in events:
                output.add(event)
                unfinished -= event.finish_reason is not None
        if output.failed:
            raise APIError(500, "the engine failed while decoding this request",
                           type="server_error")
        return output.response()
    finally:
        engine.cancel(sequences)


async def _stream(engine: Engine, pipe: EventPipe, sequences: list[Sequence], output,
                  include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: a chunk per choice per wake-up (its events merged); the usage chunk
    if asked; ``[DONE]``. A client that disconnects ends this generator (cancelled): its
    sequences are cancelled."""
    try:
        unfinished = len(sequences)
        for chunk in output.opening():
            yield _sse(chunk)
        while unfinished:
            chunks = []
            for event in merge_events(await pipe.get()):
                output.add(event)
                unfinished -= event.finish_reason is not None
                chunk = output.chunk(event)
                if chunk is not None:
                    chunks.append(_sse(chunk))
            if chunks:
                yield "".join(chunks)
        if include_usage:
            yield _sse(output.usage_chunk())
        yield "data: [DONE]\n\n"
    finally:
        engine.cancel(sequences)


def _sse(chunk: dict) -> str:
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


def metrics_text(engine: Engine) -> str:
    """``METRICS`` in Prometheus' text exposition format, named ``minigpt_<count>`` (counters
    with ``_total``)."""
    values = engine.counts()
    lines = []
    for count, kind, help_text in METRICS:
        name = f"minigpt_{count}" + ("_total" if kind == "counter" else "")
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
                  f"{name} {values[count]}"]
    return "\n".join(lines) + "\n"


def _key_check(api_key: str | None):
    """A dependency refusing requests without ``Authorization: Bearer <api_key>`` (compared
    in constant time); none when no key is set."""
    expected = None if not api_key else api_key.encode()

    async def check(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(),
                                                                    expected):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer "
                           "<key>'", type="authentication_error", code="invalid_api_key")

    return check


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
        else:
            message = f"{'.'.join(loc) or 'body'}: {first.get('msg')}"
            if "input" in first and loc:
                message += f" (got {json.dumps(first['input'], default=str)[:80]})"
        return JSONResponse(error_body(message, "invalid_request_error", loc[0] if loc else None),
                            status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {e.detail}"
        return JSONResponse(error_body(message, kind), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def bug(request: Request, e: Exception):
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"),
                            status_code=500)


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` (declared or streamed) is a 413."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await self._refuse(send)

    async def _refuse(self, send) -> None:
        body = json.dumps(error_body(f"request body is larger than {self.max_bytes} bytes "
                                     "(max_body_bytes)", "invalid_request_error",
                                     code="body_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass
