"""A bounded load on loopback: 400 requests, 32 at a time, within a fixed time, against the tiny
chat model served in this process (max_batch 16, so requests also wait in the queue).

Completions and chat completions, streamed and not, greedy, of 8 prompts and 4 lengths. Every
response must be a 200 and complete (a finish reason; a stream ends with ``[DONE]`` after its
usage chunk), every answer must equal the model's greedy answer re-read token by token without a
cache (the oracle, cut to the request's length), and the resident memory of the process after
the load must stay within 10% of what it was after the warm-up (the server runs in this
process; the client's own share stays flat).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
from pathlib import Path

import httpx
import pytest
from chat_helpers import char_tokenizer, chat_template, reread_reply, tiny_chat_model

from tests.serve.conftest import CONTEXT

REQUESTS, CONCURRENT, WARMUP = 400, 32, 64
TIME_LIMIT_S = 120  # the whole load; seconds on 2 busy cores
PROMPTS = ["the cat", "1+1=", "hello there, how are", "a", "zebra crossing ", "42", "why?",
           "so it goes. and so"]
LENGTHS = [1, 4, 9, 16]
KINDS = [(endpoint, stream) for endpoint in ("completions", "chat") for stream in (False, True)]

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(),
                                reason="reads resident memory from /proc (Linux)")


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def oracle_answers() -> dict[tuple[str, str], str]:
    """(endpoint, prompt) -> the greedy answer of the longest length, from the tiny chat model
    (seed 1, as conftest's chat checkpoint) re-reading its whole sequence for every token."""
    model, tokenizer = tiny_chat_model(CONTEXT, seed=1), char_tokenizer()
    template, allowed = chat_template(tokenizer), tokenizer.eot_id
    answers = {}
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        answers["completions", prompt] = tokenizer.decode(
            reread_reply(model, ids, tokenizer.eot_id, allowed, max(LENGTHS)))
        chat_ids = template.prompt_ids([{"role": "user", "content": prompt}])
        answers["chat", prompt] = tokenizer.decode(
            reread_reply(model, chat_ids, template.end_id, allowed, max(LENGTHS)))
    return answers


def request_body(endpoint: str, stream: bool, prompt: str, max_tokens: int) -> dict:
    body = {"max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if endpoint == "chat":
        return {**body, "messages": [{"role": "user", "content": prompt}]}
    return {**body, "prompt": prompt}


async def send(client: httpx.AsyncClient, endpoint: str, stream: bool, prompt: str,
               max_tokens: int) -> dict:
    """One request -> {status, text, finish_reason, usage, done}; ``done``: a stream's
    ``[DONE]`` came (always True for a plain response)."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    body = request_body(endpoint, stream, prompt, max_tokens)
    if not stream:
        response = await client.post(path, json=body)
        if response.status_code != 200:
            return {"status": response.status_code, "body": response.text}
        choice, usage = response.json()["choices"][0], response.json()["usage"]
        text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
        return {"status": 200, "text": text, "finish_reason": choice["finish_reason"],
                "usage": usage, "done": True}
    result = {"text": "", "finish_reason": None, "usage": None, "done": False}
    async with client.stream("POST", path, json=body) as response:
        result["status"] = response.status_code
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result["done"] = True
                continue
            chunk = json.loads(line[6:])
            result["usage"] = chunk.get("usage") or result["usage"]
            for choice in chunk["choices"]:
                piece = choice["delta"].get("content") if endpoint == "chat" else choice["text"]
                result["text"] += piece or ""
                result["finish_reason"] = choice.get("finish_reason") or result["finish_reason"]
    return result


async def run_load(url: str, count: int) -> list[tuple[tuple, dict]]:
    """``count`` requests cycling through every kind, prompt and length, ``CONCURRENT`` at a
    time: (what was asked, what came back) each."""
    asks = list(itertools.islice(itertools.cycle(itertools.product(KINDS, PROMPTS, LENGTHS)),
                                 count))
    gate = asyncio.Semaphore(CONCURRENT)
    limits = httpx.Limits(max_connections=CONCURRENT)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        async def one(ask):
            (endpoint, stream), prompt, max_tokens = ask
            async with gate:
                return ask, await send(client, endpoint, stream, prompt, max_tokens)

        return await asyncio.wait_for(asyncio.gather(*(one(a) for a in asks)), TIME_LIMIT_S)


def test_bounded_load_completes_every_request_without_growing(start_server, chat_checkpoint):
    # the plain model: minigpt.cpu's oneDNN-packed weights keep a primitive per new batch
    # shape (a cache bounded by oneDNN's capacity, which a warm-up this short does not fill)
    server = start_server(chat_checkpoint, max_batch=16, max_queue=64, cpu_speedups=False)
    expected = oracle_answers()
    asyncio.run(run_load(server.url, WARMUP))
    gc.collect()
    warm = resident_bytes()

    results = asyncio.run(run_load(server.url, REQUESTS))
    gc.collect()
    after = resident_bytes()

    assert len(results) == REQUESTS
    failed = [(ask, r) for ask, r in results if r["status"] != 200]
    assert not failed, f"{len(failed)} requests failed, e.g. {failed[0]}"
    for ((endpoint, stream), prompt, max_tokens), r in results:
        asked = f"{endpoint} stream={stream} {prompt!r} max_tokens={max_tokens}"
        assert r["done"] and r["usage"] is not None, f"incomplete response to {asked}"
        answer = expected[endpoint, prompt][:max_tokens]
        assert r["text"] == answer, asked
        assert r["usage"]["completion_tokens"] <= max_tokens, asked
        assert r["finish_reason"] == ("length" if r["usage"]["completion_tokens"] == max_tokens
                                      else "stop"), asked
    assert server.service.engine.stats.largest_batch > 1  # the requests did decode together
    assert after <= 1.10 * warm, (f"resident memory grew from {warm / 2**20:.0f} MiB after the "
                                  f"warm-up to {after / 2**20:.0f} MiB after {REQUESTS} requests")
