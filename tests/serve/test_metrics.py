"""``GET /metrics``: the engine's counts in Prometheus' text format, read by Prometheus' own
parser and checked against what the served requests reported (their usage) and did."""

import time
from dataclasses import fields

import httpx
from prometheus_client.parser import text_string_to_metric_families

from minigpt.serve.app import METRICS
from minigpt.serve.engine import EngineStats


def scrape(url, **kwargs) -> dict[str, float]:
    response = httpx.get(f"{url}/metrics", timeout=30, **kwargs)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {sample.name: sample.value
            for family in text_string_to_metric_families(response.text)
            for sample in family.samples}


def test_metrics_count_what_the_requests_did(base_checkpoint, start_server):
    server = start_server(base_checkpoint, api_key="k")
    auth = {"authorization": "Bearer k"}
    assert httpx.get(f"{server.url}/metrics", timeout=30).status_code == 401  # as the API
    before = scrape(server.url, headers=auth)
    # every count is served, each engine field among them, all zero before any request
    exported = {count for count, _, _ in METRICS}
    assert {f.name for f in fields(EngineStats)} <= exported
    assert len(before) == len(METRICS) and set(before.values()) == {0}
    usages = []
    for prompt, max_tokens in [("to be", 9), ("or not", 4), ("x", 1)]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, headers=auth,
                           timeout=60).json()
        usages.append((reply["usage"], reply["choices"][0]["finish_reason"]))
    deadline = time.monotonic() + 10  # a finished row leaves at the engine's next round
    while (after := scrape(server.url, headers=auth))["minigpt_running"] and \
            time.monotonic() < deadline:
        time.sleep(0.01)
    assert after["minigpt_prompt_tokens_total"] == sum(u["prompt_tokens"] for u, _ in usages)
    # every sampled token: the completion's, and an end-of-text token where one ended it
    sampled = [u["completion_tokens"] + (reason == "stop") for u, reason in usages]
    assert after["minigpt_generated_tokens_total"] == sum(sampled)
    # one at a time: the first token comes from the prompt's read, each other from a step of 1 row
    assert after["minigpt_decode_steps_total"] == sum(sampled) - len(usages)
    assert after["minigpt_decode_step_rows_total"] == after["minigpt_decode_steps_total"]
    assert after["minigpt_largest_batch"] == 1
    assert (after["minigpt_running"], after["minigpt_waiting"]) == (0, 0)
    assert after["minigpt_cancelled_total"] == 0
    for part in ("prefill", "decode_forward", "decode_sampling"):
        assert after[f"minigpt_{part}_seconds_total"] > 0
