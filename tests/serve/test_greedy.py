"""Greedy text from /v1/completions equals ``generate.py temperature=0`` (generate's own code
path, run here on the same checkpoint and prompt), alone and as one of 8 concurrent requests
with different prompts and lengths."""

import asyncio
import io
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx

from generate import run as generate_run
from minigpt.config import GenerateSchema
from minigpt.serve.app import EventPipe
from minigpt.serve.config import ServeSchema
from minigpt.serve.engine import Engine
from minigpt.serve.sequence import Event
from minigpt.serve.server import load_service, serve_in_thread

PROMPTS = ["the cat", "1+1=", "hello there, how are", "a", "zebra crossing ", "42",
           "why?", "so it goes. and so"]
LENGTHS = [12, 5, 20, 9, 16, 7, 3, 14]


def generate_py(checkpoint, prompt: str, max_new_tokens: int) -> str:
    """What ``python generate.py ckpt_path=... prompt=... temperature=0`` prints, less the
    prompt."""
    cfg = GenerateSchema(ckpt_path=str(checkpoint), prompt=prompt, temperature=0,
                         max_new_tokens=max_new_tokens, device="cpu", dtype="float32",
                         stream=False)
    [sample] = generate_run(cfg, out=io.StringIO())
    return sample[len(prompt):]


def complete(url: str, prompt: str, max_tokens: int) -> dict:
    response = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def test_greedy_alone_and_in_a_batch_equal_generate_py(base_checkpoint, base_server):
    base_server_url = base_server.url
    expected = [generate_py(base_checkpoint, p, n) for p, n in zip(PROMPTS, LENGTHS,
                                                                     strict=True)]
    alone = complete(base_server_url, PROMPTS[2], LENGTHS[2])
    assert alone["choices"][0]["text"] == expected[2]
    assert alone["usage"]["prompt_tokens"] == len(PROMPTS[2])
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda a: complete(base_server_url, *a),
                                 zip(PROMPTS, LENGTHS, strict=True)))
    assert [r["choices"][0]["text"] for r in together] == expected
    assert base_server.service.engine.stats.largest_batch > 1  # they did decode together
    for r, n in zip(together, LENGTHS, strict=True):  # stopped by end-of-text, or full length
        assert r["usage"]["completion_tokens"] <= n
        assert (r["choices"][0]["finish_reason"] == "length") == \
            (r["usage"]["completion_tokens"] == n)


def streamed_texts(url: str, prompt: str, max_tokens: int) -> list[str]:
    """The text of each server-sent event of a streamed greedy completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    texts = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                texts += [c["text"] for c in json.loads(line[6:])["choices"] if c["text"]]
    return texts


def test_a_stream_sends_the_tokens_of_an_interval_together(base_checkpoint, start_server):
    """stream_interval: the tokens between the first and the end go out at most every interval
    (here longer than the request: with the end); the text is generate.py's either way."""
    expected = generate_py(base_checkpoint, PROMPTS[2], LENGTHS[2])
    every_token = start_server(base_checkpoint)
    assert "".join(streamed_texts(every_token.url, PROMPTS[2], LENGTHS[2])) == expected
    together = start_server(base_checkpoint, stream_interval=10.0)
    texts = streamed_texts(together.url, PROMPTS[2], LENGTHS[2])
    assert "".join(texts) == expected
    # the first token, then the rest; one event if the decoding ended before the first was sent
    assert len(texts) <= 2


def test_the_event_pipe_wakes_the_loop_for_a_first_and_a_last_event_only():
    """``EventPipe`` with a 10 s interval, fed from another thread as the engine feeds it: a
    waiting stream gets a sequence's first event at once, the next ones only with its end."""
    def put(pipe, event):
        thread = threading.Thread(target=pipe.put, args=(event,))
        thread.start()
        thread.join()

    async def main():
        pipe = EventPipe(asyncio.get_running_loop(), interval=10.0)
        waiting = asyncio.ensure_future(pipe.get())
        await asyncio.sleep(0.05)
        put(pipe, Event(0, "a"))
        assert [e.text for e in await asyncio.wait_for(waiting, 5)] == ["a"]
        waiting = asyncio.ensure_future(pipe.get())
        await asyncio.sleep(0.05)
        put(pipe, Event(0, "b"))
        put(pipe, Event(0, "c"))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # not woken within the interval
        put(pipe, Event(0, "d", finish_reason="length"))
        assert [e.text for e in await asyncio.wait_for(waiting, 5)] == ["b", "c", "d"]

    asyncio.run(main())


def test_fixed_shape_steps_give_generate_py_text(base_checkpoint):
    """The engine's fixed-shape steps (a GPU's CUDA graphs, run eagerly here) for batches of up
    to 4 rows, eager steps above: 8 concurrent requests still get generate.py's greedy text."""
    service = load_service(ServeSchema(ckpt_path=str(base_checkpoint), device="cpu",
                                       dtype="float32", port=0))
    service.engine = Engine(service.engine.model, max_batch=8, graph_rows=4)
    expected = [generate_py(base_checkpoint, p, n) for p, n in zip(PROMPTS, LENGTHS,
                                                                     strict=True)]
    with serve_in_thread(service) as server, ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda a: complete(server.url, *a),
                                 zip(PROMPTS, LENGTHS, strict=True)))
    assert [r["choices"][0]["text"] for r in together] == expected
    fixed = service.engine.batch.fixed_steps
    assert fixed.max_rows == 4 and fixed.length > 0  # the last rows stepped on fixed shapes
