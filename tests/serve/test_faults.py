"""Bad requests, bad clients and a stop signal: each gets OpenAI's error shape with the right
status, and nothing that goes wrong for one request changes another's output."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from chat_helpers import ROOT
from conftest import wait_for
from slow_engine import delayed_step

from minigpt.errors import ConfigError, ResourceError, UserError
from minigpt.serve import server
from minigpt.serve.batch import RunningBatch
from minigpt.serve.config import ServeSchema
from minigpt.serve.server import check_address, check_settings, graph_rows, load_service


def post(url, path="/v1/completions", **kwargs):
    return httpx.post(f"{url}{path}", timeout=60, **kwargs)


def assert_error(response, status, param=None, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def test_malformed_and_mistyped_bodies_are_400(base_server_url):
    bad_json = post(base_server_url, content=b'{"prompt": "a",',
                    headers={"content-type": "application/json"})
    assert "not valid JSON" in assert_error(bad_json, 400)["message"]
    assert_error(post(base_server_url, json={"prompt": "a", "max_tokens": "5"}), 400,
                 "max_tokens")
    assert_error(post(base_server_url, json={"prompt": "a", "temperature": "hot"}), 400,
                 "temperature")
    assert_error(post(base_server_url, json={"prompt": 5}), 400, "prompt")
    assert_error(post(base_server_url, json={"max_tokens": 3}), 400, "prompt")
    assert_error(post(base_server_url, json={"prompt": [10 ** 6]}), 400, "prompt")
    assert_error(post(base_server_url, json={"prompt": "a", "presence_penalty": 1.0}), 400,
                 "presence_penalty")
    assert_error(httpx.get(f"{base_server_url}/v1/nothing"), 404)


def test_unknown_fields_are_ignored(base_server_url):
    response = post(base_server_url, json={"prompt": "ab", "max_tokens": 2, "user": "u",
                                           "logit_bias": {}, "a_future_field": [1, 2]})
    assert response.status_code == 200, response.text


def test_context_and_max_tokens_limits(base_server_url):
    assert_error(post(base_server_url, json={"prompt": "a" * 97, "max_tokens": 1}), 400,
                 code="context_length_exceeded")
    assert_error(post(base_server_url, json={"prompt": "a" * 90, "max_tokens": 7}), 400,
                 "max_tokens", "context_length_exceeded")
    assert_error(post(base_server_url, json={"prompt": "a", "max_tokens": 10 ** 9}), 400,
                 "max_tokens")
    zero = post(base_server_url, json={"prompt": "abc", "max_tokens": 0}).json()
    assert zero["choices"][0]["text"] == "" and zero["usage"]["completion_tokens"] == 0
    assert zero["choices"][0]["finish_reason"] == "length"


def test_a_base_model_refuses_chat(base_server_url):
    response = post(base_server_url, "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}]})
    assert "chat template" in assert_error(response, 400, code="no_chat_template")["message"]


def test_api_key_and_body_size(base_checkpoint, start_server):
    server = start_server(base_checkpoint, api_key="s3cret", max_body_bytes=2048)
    body = {"prompt": "ab", "max_tokens": 1}
    assert_error(post(server.url, json=body), 401, code="invalid_api_key")
    assert_error(post(server.url, json=body, headers={"Authorization": "Bearer s3cre"}), 401)
    assert post(server.url, json=body,
                headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert httpx.get(f"{server.url}/").status_code == 200  # the page asks for the key itself
    too_big = post(server.url, json={"prompt": "a" * 4000},
                   headers={"Authorization": "Bearer s3cret"})
    assert_error(too_big, 413, code="body_too_large")


def test_binding_beyond_loopback_needs_a_key(base_checkpoint, monkeypatch):
    monkeypatch.delenv("MINIGPT_API_KEY", raising=False)
    ckpt = str(base_checkpoint)
    with pytest.raises(ConfigError, match="host=0.0.0.0 .* needs an API key"):
        check_settings(ServeSchema(ckpt_path=ckpt, host="0.0.0.0"))
    check_settings(ServeSchema(ckpt_path=ckpt, host="0.0.0.0", api_key="k"))


def test_cuda_graph_rows_default_to_the_whole_batch_on_a_gpu_only():
    assert graph_rows(ServeSchema(max_batch=48), "cuda") == 48  # null: up to max_batch
    assert graph_rows(ServeSchema(max_batch=48, cuda_graph_rows=8), "cuda:1") == 8
    assert graph_rows(ServeSchema(max_batch=48, cuda_graph_rows=0), "cuda") == 0
    assert graph_rows(ServeSchema(max_batch=48), "cpu") == 0
    with pytest.raises(ConfigError, match="cuda_graph_rows=-1 must be an integer >= 0"):
        check_settings(ServeSchema(ckpt_path="x.ckpt", cuda_graph_rows=-1))


def test_a_batch_cache_the_device_cannot_hold_is_refused_before_it_is_allocated(
        base_checkpoint, monkeypatch):
    settings = ServeSchema(ckpt_path=str(base_checkpoint), device="cpu", dtype="float32")
    service = load_service(settings)
    c = service.config  # a row: keys and values of every layer, float32, the context
    row = 2 * c.n_layer * c.n_embd * 4 * c.context_length
    assert service.engine.batch.cache.nbytes == settings.max_batch * row
    settings.max_batch = 10**7  # terabytes: more than this machine has
    with pytest.raises(ResourceError, match=r"max_batch=10000000 needs a KV cache of [\d.,]+ GiB "
                       r"\([\d.,]+ MiB a row of \d+ tokens\) but this machine's RAM has"):
        load_service(settings)
    monkeypatch.setattr(server, "memory_available", lambda device: (10 * row, "GPU 7 (test)"))
    settings.max_batch = 10
    with pytest.raises(ResourceError, match=r"but GPU 7 \(test\) has [\d.,]+ GiB free: lower "
                                            r"max_batch \(at most 9 fit\)"):
        load_service(settings)  # 90% of the free memory: room for a prompt pass
    settings.max_batch = 9
    assert len(load_service(settings).engine.batch.cache.full.padding) == 9


def test_an_address_in_use_or_unknown_host_is_refused_before_loading():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UserError, match=f"host=127.0.0.1 port={port} cannot be listened on "
                                            r"\(Address already in use\)"):
            check_address("127.0.0.1", port)
    with pytest.raises(UserError, match="host=no.such.host.invalid port=0 cannot be listened on"):
        check_address("no.such.host.invalid", 0)
    check_address("127.0.0.1", 0)


@pytest.fixture
def slow_steps(monkeypatch):
    """Every decode step takes 20 ms more: a request stays in the batch long enough to be
    disconnected or to fill it."""
    monkeypatch.setattr(RunningBatch, "step", delayed_step(0.02))


def long_prompt(url, tokens=60):
    """A prompt whose greedy continuation runs ``tokens`` tokens without an end-of-text."""
    for prompt in ["the", "a b c", "so it goes", "12345", "zz", "hello"]:
        choice = post(url, json={"prompt": prompt, "max_tokens": tokens,
                                 "temperature": 0}).json()["choices"][0]
        if choice["finish_reason"] == "length":
            return prompt
    pytest.skip("no prompt of this tiny model runs long enough")


def test_a_client_disconnecting_mid_stream_leaves_the_batch(base_server, slow_steps):
    url, engine = base_server.url, base_server.service.engine
    prompt = long_prompt(url)
    other = {"prompt": "1+1=", "max_tokens": 30, "temperature": 0}
    expected = post(url, json=other).json()["choices"][0]["text"]
    cancelled = engine.stats.cancelled
    results = {}
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 60,
                                                   "temperature": 0, "stream": True}) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # it is decoding
        worker = threading.Thread(target=lambda: results.update(r=post(url, json=other)))
        worker.start()
        while engine.running < 2:
            time.sleep(0.005)
    # the stream is closed mid-way: its row leaves, the other request goes on unchanged
    worker.join()
    assert results["r"].json()["choices"][0]["text"] == expected
    assert engine.stats.cancelled == cancelled + 1


def test_a_full_queue_is_429_with_retry_after(base_checkpoint, start_server, slow_steps):
    server = start_server(base_checkpoint, max_batch=1, max_queue=1)
    prompt = long_prompt(server.url, 40)
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as client, \
            client.stream("POST", f"{server.url}/v1/completions", json=body) as first:
        lines = first.iter_lines()  # held: a generator dropped closes the stream
        next(line for line in lines if line.startswith("data:"))  # running
        with client.stream("POST", f"{server.url}/v1/completions", json=body) as second:
            assert second.status_code == 200  # queued behind the first
            third = client.post(f"{server.url}/v1/completions", json=body)
            assert_error(third, 429, code="queue_full")
            assert third.headers["retry-after"] == "1"


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux's /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it exited meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.parametrize("engine_process", [False, True])
def test_sigterm_mid_batch_exits_0_within_the_bound(base_checkpoint, engine_process):
    command = [sys.executable, "-m", "minigpt.serve", f"ckpt_path={base_checkpoint}", "port=0",
               "device=cpu", "dtype=float32", "shutdown_timeout=1", "log_level=info",
               f"engine_process={str(engine_process).lower()}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in server.stderr:
            match = re.search(r"running on (http://\S+)", line)
            if match:
                url = match.group(1)
                break
        assert url is not None, "the server did not start"
        body = {"prompt": "a", "max_tokens": 90, "temperature": 1.0, "seed": 1, "stream": True}
        with httpx.Client(timeout=30) as client:
            streams = [client.stream("POST", f"{url}/v1/completions", json=body)
                       for _ in range(3)]
            responses = [s.__enter__() for s in streams]
            for response in responses:
                assert json.loads(next(response.iter_lines())[6:])["object"] == \
                    "text_completion"
            children = children_of(server.pid)
            assert bool(children) == engine_process  # the engine's (and its resource tracker)
            start = time.monotonic()
            server.send_signal(signal.SIGTERM)
            assert server.wait(timeout=15) == 0, server.stderr.read()[-2000:]
            assert time.monotonic() - start < 10
            # none left (the resource tracker ends once it sees its pipe close)
            wait_for(lambda: not [c for c in children if Path(f"/proc/{c}").exists()], 5,
                     "a child of the server outlived it")
            for s in streams:
                try:
                    s.__exit__(None, None, None)
                except httpx.HTTPError:
                    pass
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
