"""The engine in a process of its own (``engine_process=true``): the same answers as
``generate.py`` alone and in a batch, cancels and refusals that reach the child, a child that
cannot load; and an engine that fails, in a thread or a process, or whose process dies: its
requests fail, new ones are refused and /health says so."""

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import settings_for, wait_for
from slow_engine import delayed_step, failing_engine_main, slow_engine_main
from test_faults import assert_error, long_prompt, post
from test_greedy import LENGTHS, PROMPTS, complete, generate_py

from minigpt.serve.batch import RunningBatch
from minigpt.serve.process import process_service
from minigpt.serve.server import load_service, serve_in_thread, uses_engine_process


def serve_process(checkpoint, **overrides):
    settings = settings_for(checkpoint, engine_process=True, **overrides)
    return serve_in_thread(process_service(settings, load_service, entry=slow_engine_main))


@pytest.fixture(scope="module")
def process_server(base_checkpoint):
    with serve_process(base_checkpoint) as server:
        yield server


def long_stream(url, tokens=60):
    """A client and the body of a streamed request that runs ``tokens`` tokens."""
    body = {"prompt": long_prompt(url, tokens), "max_tokens": tokens, "temperature": 0,
            "stream": True}
    return httpx.Client(timeout=60), body


def test_auto_is_a_process_on_a_gpu_only(base_checkpoint):
    assert not uses_engine_process(settings_for(base_checkpoint))  # auto on the CPU
    assert uses_engine_process(settings_for(base_checkpoint, engine_process=True))


def test_greedy_alone_and_in_a_batch_equal_generate_py(base_checkpoint, process_server):
    url, engine = process_server.url, process_server.service.engine
    expected = [generate_py(base_checkpoint, p, n) for p, n in zip(PROMPTS, LENGTHS,
                                                                     strict=True)]
    assert complete(url, PROMPTS[2], LENGTHS[2])["choices"][0]["text"] == expected[2]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda a: complete(url, *a), zip(PROMPTS, LENGTHS,
                                                                    strict=True)))
    assert [r["choices"][0]["text"] for r in together] == expected
    counts = engine.counts()
    assert counts["largest_batch"] > 1  # they did decode together, in the child
    assert counts["prompt_tokens"] == sum(map(len, PROMPTS)) + len(PROMPTS[2])
    assert engine.process.pid != threading.get_native_id()


def test_a_disconnected_stream_is_cancelled_in_the_child(process_server):
    url, engine = process_server.url, process_server.service.engine
    other = {"prompt": "1+1=", "max_tokens": 30, "temperature": 0}
    expected = post(url, json=other).json()["choices"][0]["text"]
    cancelled = engine.counts()["cancelled"]
    results = {}
    client, body = long_stream(url)
    with client, client.stream("POST", f"{url}/v1/completions", json=body) as stream:
        lines = stream.iter_lines()  # held: a generator dropped closes the stream
        next(line for line in lines if line.startswith("data: {"))
        worker = threading.Thread(target=lambda: results.update(r=post(url, json=other)))
        worker.start()
        wait_for(lambda: engine.counts()["running"] == 2)
    worker.join()
    assert results["r"].json()["choices"][0]["text"] == expected
    wait_for(lambda: engine.counts()["cancelled"] == cancelled + 1)
    assert not engine._live  # the server's copies of the sequences are finished too


def test_the_only_stream_cancelled_is_reported_at_once(process_server):
    url, engine = process_server.url, process_server.service.engine
    cancelled = engine.counts()["cancelled"]
    client, body = long_stream(url)
    with client, client.stream("POST", f"{url}/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
    # its row leaves an otherwise idle engine: the end still reaches the server's process
    wait_for(lambda: engine.counts()["cancelled"] == cancelled + 1 and not engine._live)


def test_a_full_queue_is_429(base_checkpoint):
    with serve_process(base_checkpoint, max_batch=1, max_queue=1) as server:
        client, body = long_stream(server.url, 80)
        with client, client.stream("POST", f"{server.url}/v1/completions", json=body) as first:
            lines = first.iter_lines()  # held: a generator dropped closes the stream
            next(line for line in lines if line.startswith("data: {"))
            with client.stream("POST", f"{server.url}/v1/completions", json=body) as second:
                assert second.status_code == 200  # queued behind the first
                assert_error(client.post(f"{server.url}/v1/completions", json=body), 429,
                             code="queue_full")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # by design
@pytest.mark.parametrize("how", ["thread fails", "process fails", "process killed"])
def test_an_engine_that_fails_fails_its_requests_refuses_more_and_is_unhealthy(
        base_checkpoint, monkeypatch, how):
    settings = settings_for(base_checkpoint, engine_process=how.startswith("process"))
    if how == "thread fails":
        monkeypatch.setattr(RunningBatch, "step", delayed_step(fail_after=3))
        service = load_service(settings)
    else:
        entry = failing_engine_main if how == "process fails" else slow_engine_main
        service = process_service(settings, load_service, entry=entry)
    with serve_in_thread(service) as server:
        engine, results = server.service.engine, {}
        prompt = long_prompt(server.url, 80) if how == "process killed" else "the"  # 3+ tokens
        body = {"prompt": prompt, "max_tokens": 80, "temperature": 0}
        worker = threading.Thread(target=lambda: results.update(r=post(server.url, json=body)))
        worker.start()
        if how == "process killed":
            wait_for(lambda: engine.counts()["running"] == 1)
            engine.process.kill()
        worker.join()
        assert_error(results["r"], 500)  # in flight: the engine failed while decoding it
        assert "engine failed" in assert_error(post(server.url, json=body), 503)["message"]
        assert ("exited (status -9)" if how == "process killed" else "a decode step failed") \
            in str(engine.error)
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"


def test_the_childs_loading_errors_are_the_servers(tmp_path):
    bad = tmp_path / "broken.ckpt"
    bad.write_bytes(b"not a checkpoint")
    settings = settings_for(bad, engine_process=True)
    with pytest.raises(Exception) as in_thread:
        load_service(settings)
    with pytest.raises(type(in_thread.value)) as in_process:
        process_service(settings, load_service)
    assert str(in_process.value) == str(in_thread.value)
