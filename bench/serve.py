"""Serving with continuous batching, measured against a live ``python -m minigpt.serve`` on loopback.

    python -m bench.serve                     # toy model shape on the CPU, 16 clients, a minute or two
    python -m bench.serve --model gpt2_small --clients 64   # on a GPU (--device auto)
    python -m bench.serve --self-test         # a tiny model, seconds (tests/test_bench_serve.py)
    python -m bench.serve --set cuda_graph_rows=8 --set stream_interval=0.05   # server settings

A model of ``configs/model/<--model>.yaml``'s shape with random weights (seeded; the character
tokenizer for ``toy``, GPT-2's otherwise) is written to a temporary checkpoint and served by a
server process of its own (``--threads`` torch threads, ``max_batch`` = ``--clients``). Each
round, interleaved so machine noise hits every part alike:

- one at a time: ``--alone`` (16, at most ``--clients``) streamed greedy ``/v1/completions``
  requests (different prompts, ``--tokens`` new tokens each), each sent when the previous one
  finished;
- together: ``--clients`` such requests sent at once;
- overhead: one streamed greedy request of ``--overhead-tokens``, then the same prompt decoded
  in this process the way ``generate.py`` decodes (``minigpt.sampling.generate`` on the model
  ``minigpt.inference`` loads and places; compiled on a GPU, eager on the CPU), while the
  server idles.

The table has each part's medians over ``--repeats`` rounds (after ``--warmup``): tokens/s
(completion tokens over wall time, so end-of-text stopping early is counted as it happened) and
the p50 time to the first streamed token. The ratios are medians of per-round ratios, and each
target prints one line, met or NOT met. The last line counts the requests whose greedy text
together equals their text alone (batching must not change a greedy answer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import torch
from prometheus_client.parser import text_string_to_metric_families

from minigpt.devices import check_device, inference_dtype

ROOT = Path(__file__).resolve().parents[1]
CHARS = "\n !',.:;?abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
WORDS = ("to be or not to be that is the question whether tis nobler in the mind to suffer the "
         "slings and arrows of outrageous fortune or to take arms against a sea of troubles").split()
TINY_SHAPE = {"n_layer": 2, "n_head": 2, "n_embd": 32, "context_length": 64}


@dataclass
class Reply:
    """One streamed request as the client saw it."""

    text: str
    tokens: int  # completion tokens (the usage count when the server sends one)
    first_token_s: float  # from sending to the first streamed text
    total_s: float


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.self_test:
        args.clients, args.tokens, args.overhead_tokens = 4, 8, 16
        args.warmup, args.repeats, args.threads, args.dtype = 0, 1, 1, "float32"
    args.alone = min(args.alone, args.clients)
    args.device = check_device(args.device)
    args.dtype = str(inference_dtype(args.dtype, args.device)).removeprefix("torch.")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        ckpt = _write_checkpoint(Path(tmp) / "model.ckpt", args)
        local_decode = _local_decoder(ckpt, args)
        with _server(ckpt, args, Path(tmp) / "server.log") as url:
            rounds = asyncio.run(_measure(url, args, local_decode))
    _report(args, rounds)


def _write_checkpoint(path: Path, args) -> Path:
    """Random weights of the model shape in the documented checkpoint format."""
    from bench.recipe_configs import train_config
    from minigpt.checkpoint import checkpoint_metadata
    from minigpt.model import GPT, GPTConfig
    from minigpt.tokenizer import CharTokenizer, get_tokenizer

    if args.self_test:
        shape = TINY_SHAPE
    else:
        model = train_config(f"model={args.model}").model  # what python train.py composes
        shape = {k: model[k] for k in ("n_layer", "n_head", "n_embd", "context_length")}
    tokenizer = CharTokenizer(CHARS) if args.model == "toy" else get_tokenizer("gpt2")
    vocab_size = -(-tokenizer.vocab_size // 64) * 64
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(vocab_size=vocab_size, **shape))
    meta = checkpoint_metadata(model.config.to_dict(), tokenizer.to_dict())
    torch.save({"model": {"model." + k: v for k, v in model.state_dict().items()},
                "minigpt": meta}, path)
    return path


@contextmanager
def _server(ckpt: Path, args, log_path: Path):
    """A server process on a free loopback port, ready to answer; stopped on exit."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "minigpt.serve", f"ckpt_path={ckpt}", f"port={port}",
               f"device={args.device}", f"dtype={args.dtype}", f"max_batch={args.clients}",
               f"max_queue={4 * args.clients}", "log_level=warning", *args.set]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_ready(url, process, log_path, args.start_timeout)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def _wait_until_ready(url: str, process, log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited ({process.returncode}):\n"
                             f"{log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:  # refused, reset, timed out, or an HTTP error status
            pass
        time.sleep(0.2)
    raise SystemExit(f"the server did not answer within {timeout:.0f} s "
                     f"(--start-timeout):\n{log_path.read_text()[-2000:]}")


def _prompts(count: int) -> list[str]:
    """``count`` different prompts of about the same length."""
    return [" ".join(WORDS[(7 * n + i) % len(WORDS)] for i in range(6)) for n in range(count)]


async def _complete(session: aiohttp.ClientSession, prompt: str, max_tokens: int) -> Reply:
    """One streamed greedy completion, timed from sending to its first text and to its end."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, pieces, usage = None, [], None
    async with session.post("/v1/completions", json=body) as response:
        if response.status != 200:
            raise SystemExit(f"HTTP {response.status}: {(await response.read())[:500]}")
        async for raw in response.content:  # one line at a time
            line = raw.decode().rstrip("\r\n")
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            text = "".join(choice.get("text", "") for choice in chunk.get("choices", []))
            if text:
                first = first or time.perf_counter()
                pieces.append(text)
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else len(pieces)
    return Reply("".join(pieces), tokens, (first or end) - start, end - start)


async def _measure(url: str, args, local_decode) -> list[dict]:
    """Per round: the requests one at a time, together, the one-client overhead request and
    the in-process decode of its prompt. The client is aiohttp: httpx's own work per streamed
    request, serialized in this one process, would be most of what 16 clients measure."""
    prompts = _prompts(args.clients)
    overhead_prompt = _prompts(1)[0]
    rounds = []
    async with aiohttp.ClientSession(
            base_url=url, connector=aiohttp.TCPConnector(limit=args.clients + 1),
            timeout=aiohttp.ClientTimeout(total=args.request_timeout)) as session:
        for n in range(args.warmup + args.repeats):
            start = time.perf_counter()
            alone = [await _complete(session, p, args.tokens) for p in prompts[:args.alone]]
            alone_s = time.perf_counter() - start
            counts = await _engine_counts(session)
            start = time.perf_counter()
            together = await asyncio.gather(*(_complete(session, p, args.tokens)
                                              for p in prompts))
            together_s = time.perf_counter() - start
            counts = {k: v - counts[k] for k, v in (await _engine_counts(session)).items()}
            single = await _complete(session, overhead_prompt, args.overhead_tokens)
            local = local_decode()
            if n >= args.warmup:
                rounds.append({"alone": alone, "alone_s": alone_s, "together": together,
                               "together_s": together_s, "engine": counts, "single": single,
                               "local": local})
    return rounds


async def _engine_counts(session: aiohttp.ClientSession) -> dict[str, float]:
    """The server's ``GET /metrics`` counters, read with Prometheus' own parser."""
    async with session.get("/metrics") as response:
        text = await response.text()
    return {sample.name.removeprefix("minigpt_"): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name.endswith("_total")}


def _local_decoder(ckpt: Path, args):
    """A function decoding the overhead prompt in this process as ``generate.py`` decodes it,
    returning tokens/s (the model loaded, placed and warmed up once here)."""
    from minigpt.inference import load_for_inference
    from minigpt.sampling import generate, pad_prompts

    loaded = load_for_inference(str(ckpt), device=args.device, dtype=args.dtype)
    compiled = loaded.device.startswith("cuda")  # generate.py's decoder=auto
    loaded.place(traceable=compiled)
    eot = loaded.tokenizer.eot_id
    idx, _ = pad_prompts([loaded.tokenizer.encode(_prompts(1)[0])], eot, device=loaded.device)
    decoder = None
    if compiled:
        from minigpt.static_decoding import StaticDecoder

        decoder = StaticDecoder(loaded.model, 1, compile=True,
                                capacity=idx.shape[1] + args.overhead_tokens)

    def decode() -> float:
        _synchronize(loaded.device)
        start = time.perf_counter()
        out = generate(loaded.model, idx, args.overhead_tokens, temperature=0, eos_id=eot,
                       vocab_size=loaded.tokenizer.vocab_size, decoder=decoder)
        new = out[0, idx.shape[1]:].tolist()  # read back to the host: no sync needed
        seconds = time.perf_counter() - start
        return (new.index(eot) if eot in new else len(new)) / seconds

    decode()  # warm-up (a compiled decoder compiles here)
    return decode


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _report(args, rounds: list[dict]) -> None:
    def rate(replies, seconds):
        return sum(r.tokens for r in replies) / seconds

    def p50_first(replies):
        return statistics.median(r.first_token_s for r in replies)

    alone = [rate(r["alone"], r["alone_s"]) for r in rounds]
    together = [rate(r["together"], r["together_s"]) for r in rounds]
    single = [r["single"].tokens / r["single"].total_s for r in rounds]
    local = [r["local"] for r in rounds]
    first_alone = [p50_first(r["alone"]) for r in rounds]
    first_together = [p50_first(r["together"]) for r in rounds]
    median = statistics.median
    model = "tiny (self-test)" if args.self_test else args.model
    print(f"{model} model on {args.device} ({args.dtype}), {args.threads} thread(s), "
          f"{args.clients} clients x {args.tokens} greedy tokens, median of {args.repeats} "
          "round(s)")
    header = f"{'':<34} {'tokens/s':>10} {'p50 first token ms':>19}"
    print(header)
    print("-" * len(header))
    print(f"{'one client at a time':<34} {median(alone):>10.1f} {1e3 * median(first_alone):>19.1f}")
    print(f"{f'{args.clients} clients together':<34} {median(together):>10.1f} "
          f"{1e3 * median(first_together):>19.1f}")
    print(f"{f'one client, {args.overhead_tokens} tokens (server)':<34} "
          f"{median(single):>10.1f} {'':>19}")
    print(f"{'generate.py decode, in process':<34} {median(local):>10.1f} {'':>19}")
    speedup = args.target_speedup or (10.0 if args.device.startswith("cuda") else 4.0)
    _target(f"aggregate tokens/s, {args.clients} together / one at a time",
            [t / a for t, a in zip(together, alone, strict=True)], ">=", speedup)
    _target(f"p50 first token, {args.clients} together / one at a time",
            [t / a for t, a in zip(first_together, first_alone, strict=True)], "<=", 3.0)
    _target("one client's tokens/s, server / generate.py decode",
            [s / local for s, local in zip(single, local, strict=True)], ">=", 0.9)
    _engine_line(args, [r["engine"] for r in rounds], [r["together_s"] for r in rounds])
    last = rounds[-1]
    equal = sum(a.text == t.text for a, t in zip(last["alone"], last["together"], strict=False))
    print(f"greedy text together == alone in {equal} of {args.alone} requests (last round); "
          f"completion tokens {sum(r.tokens for r in last['together'])} of "
          f"{args.clients * args.tokens} asked")


def _engine_line(args, counts: list[dict], seconds: list[float]) -> None:
    """Where the engine's time went while the clients ran together (medians over rounds): its
    decode steps' rows and, per step, the forward, the sampling, the prompts read, and the rest
    (the thread waiting for the interpreter lock or for work)."""
    median = statistics.median
    steps = [c["decode_steps_total"] or 1 for c in counts]

    def per_step(values: list[float]) -> float:
        return 1e3 * median(v / n for v, n in zip(values, steps, strict=True))

    def column(key: str) -> list[float]:
        return [c[key] for c in counts]

    busy = [c["decode_forward_seconds_total"] + c["decode_sampling_seconds_total"]
            + c["prefill_seconds_total"] for c in counts]
    rest = [s - b for s, b in zip(seconds, busy, strict=True)]
    rows = median(c["decode_step_rows_total"] / n for c, n in zip(counts, steps, strict=True))
    print(f"engine, {args.clients} together: {median(steps):.0f} decode steps of {rows:.1f}"
          f" rows on average; per step {per_step(seconds):.2f} ms: forward "
          f"{per_step(column('decode_forward_seconds_total')):.2f}, sampling "
          f"{per_step(column('decode_sampling_seconds_total')):.2f}, prompts "
          f"{per_step(column('prefill_seconds_total')):.2f}, the rest {per_step(rest):.2f}")


def _target(name: str, ratios: list[float], sense: str, bound: float) -> None:
    ratio = statistics.median(ratios)
    met = ratio >= bound if sense == ">=" else ratio <= bound
    print(f"{name}: {ratio:.2f}x (target {sense} {bound:g}x): {'met' if met else 'NOT met'}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="toy",
                        help="configs/model/<name>.yaml's shape (random weights); default toy")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--overhead-tokens", type=int, default=128,
                        help="new tokens of the one-client request compared with generate.py")
    parser.add_argument("--alone", type=int, default=16,
                        help="how many of the requests are also sent one at a time (default 16, "
                        "at most --clients)")
    parser.add_argument("--device", default="auto", help="auto: cuda if there is a GPU")
    parser.add_argument("--dtype", default="auto", help="as generate.py's dtype= (auto: "
                        "bfloat16 where the machine multiplies it natively)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the server and of the in-process decode (default "
                        "1: a small model decodes fastest on one)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds; medians reported")
    parser.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    parser.add_argument("--target-speedup", type=float, default=None,
                        help="aggregate tokens/s target (default 4 on the CPU, 10 on a GPU)")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a server setting (configs/serve.yaml), e.g. cuda_graph_rows=8; "
                        "repeatable")
    parser.add_argument("--self-test", action="store_true",
                        help="a tiny model, 4 clients x 8 tokens, one round: checks the bench runs")
    return parser


if __name__ == "__main__":
    main()
