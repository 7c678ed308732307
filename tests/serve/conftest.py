"""Fixtures of the server tests: tiny checkpoints (a chat model with its template, a base model
without one) and the server running them in this process on a free loopback port."""

from __future__ import annotations

import time

import pytest
from chat_helpers import char_tokenizer, chat_template, save_chat_checkpoint, tiny_chat_model

from minigpt.serve.config import ServeSchema
from minigpt.serve.server import load_service, serve_in_thread

CONTEXT = 96


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory):
    """A tiny character-level model (2 layers, 32 dims, context 96) with a chat template."""
    tokenizer = char_tokenizer()
    path = tmp_path_factory.mktemp("serve") / "chat.ckpt"
    return save_chat_checkpoint(path, tiny_chat_model(CONTEXT, seed=1), tokenizer,
                                chat_template(tokenizer))


@pytest.fixture(scope="session")
def base_checkpoint(tmp_path_factory):
    """The same shape without a chat template (a base model)."""
    path = tmp_path_factory.mktemp("serve") / "base.ckpt"
    return save_chat_checkpoint(path, tiny_chat_model(CONTEXT, seed=2), char_tokenizer())


def wait_for(condition, seconds: float = 10.0, what: str = "timed out") -> None:
    """Poll ``condition()`` until it holds; fail with ``what`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def settings_for(checkpoint, **overrides) -> ServeSchema:
    """Serve settings for a test: the CPU, float32 (so outputs match in-process references)."""
    return ServeSchema(ckpt_path=str(checkpoint), device="cpu", dtype="float32", port=0,
                       **overrides)


@pytest.fixture
def start_server():
    """``start_server(checkpoint, api_key=None, **settings) -> ThreadedServer`` (``.url``,
    ``.service``); every server started is stopped after the test."""
    servers = []

    def start(checkpoint, *, api_key=None, max_body_bytes=1_000_000, stream_interval=0.0,
              **overrides):
        service = load_service(settings_for(checkpoint, **overrides))
        server = serve_in_thread(service, api_key=api_key, max_body_bytes=max_body_bytes,
                                 stream_interval=stream_interval)
        servers.append(server.__enter__())
        return server

    yield start
    for server in reversed(servers):
        server.__exit__(None, None, None)


@pytest.fixture(scope="module")
def chat_server(chat_checkpoint):
    """The chat model served (a ``ThreadedServer``: ``.url``, ``.service``), per test module."""
    with serve_in_thread(load_service(settings_for(chat_checkpoint))) as server:
        yield server


@pytest.fixture(scope="module")
def base_server(base_checkpoint):
    """The base model served, per test module."""
    with serve_in_thread(load_service(settings_for(base_checkpoint))) as server:
        yield server


@pytest.fixture
def server_url(chat_server) -> str:
    """``http://127.0.0.1:PORT`` of the chat model, shared by a test module."""
    return chat_server.url


@pytest.fixture
def base_server_url(base_server) -> str:
    """``http://127.0.0.1:PORT`` of the base model, shared by a test module."""
    return base_server.url
