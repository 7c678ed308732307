"""The attention variants side by side: training step time and memory, decoding speed, and
decoding memory over long generations.

    python bench/attention_variants.py                       # all three tables (~10 min, 2 cores)
    python bench/attention_variants.py --lengths 256 512 --warmup 1 --repeats 1 --decode-layers 2

1. One ``MultiHeadAttention`` of GPT-2 small's shape (768 dims, 12 heads), batch 1, forward +
   backward in float32 at T = 256 .. 2048 per variant: GPT-2's block, grouped-query (4 kv heads),
   multi-query (1), rope, a 256-token window, rope + window. All variants are built in this
   process and timed interleaved (median of ``--repeats`` after ``--warmup``); "vs gpt2" is the
   median of per-round ratios. Peak memory: each (variant, T) in its own process
   (``peak_memory.py``).
2. Decoding: new tokens/s of a GPT-2-small-shaped model (``--decode-layers`` layers) one token at
   a time with ``--cached`` tokens already in the KV cache, MHA vs GQA vs MQA, and the KV-cache
   bytes per token.
3. Decoding memory: a toy-sized rope + window model generates 1x, 2x and 4x its context_length
   (each in its own process); the peak memory stays flat because the ring-buffer caches hold
   ``window`` tokens, however long the generation. The same model without the window, for
   comparison, caches its whole context and crops and refills it.

This replaces nothing in ``bench/attention.py`` (the fused block against the book's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from peak_memory import in_subprocess, peak_extra_mib  # noqa: E402
from timing import add_timing_arguments, clock, configure_timing, print_header  # noqa: E402

from minigpt.attention import MultiHeadAttention  # noqa: E402
from minigpt.model import GPT, GPTConfig  # noqa: E402
from minigpt.sampling import generate  # noqa: E402

C, HEADS = 768, 12
VARIANTS = {  # name -> MultiHeadAttention keywords
    "gpt2": {},
    "gqa4": {"num_kv_heads": 4},
    "mqa": {"num_kv_heads": 1},
    "rope": {"rope": True},
    "window256": {"window": 256},
    "rope+window256": {"rope": True, "window": 256},
}
DECODE_VARIANTS = {"gpt2": None, "gqa4": 4, "mqa": 1}  # name -> num_kv_heads
LONG = dict(vocab_size=128, context_length=256, n_layer=4, n_head=4, n_embd=256, position="rope")
LONG_VARIANTS = {"rope+window64": 64, "rope": None}  # name -> window


def build(variant: str, T: int, seed: int = 0):
    torch.manual_seed(seed)
    attn = MultiHeadAttention(C, C, T, 0.0, HEADS, True, **VARIANTS[variant]).train()
    data = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, T, C, generator=data).requires_grad_()
    return attn, x, torch.randn(1, T, C, generator=data)


def step(attn, x, grad) -> None:
    attn.zero_grad(set_to_none=True)
    x.grad = None
    attn(x).backward(grad)


def time_training(T: int, warmup: int, repeats: int) -> dict[str, list[float]]:
    runs = {v: build(v, T) for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in runs}
    for i in range(warmup + repeats):
        for variant, run in runs.items():
            start = clock()
            step(*run)
            if i >= warmup:
                times[variant].append(clock() - start)
    return times


def training_memory(variant: str, T: int) -> float:
    """In a fresh process: one forward + backward step's extra MiB."""
    run = build(variant, T)
    step(*run)
    return peak_extra_mib(lambda: step(*run))


def decode_rates(layers: int, cached: int, new: int, repeats: int) -> dict[str, tuple]:
    """(new tokens/s, KV-cache bytes per token) per grouping, steps timed after the prefill."""
    models = {}
    for name, kv in DECODE_VARIANTS.items():
        torch.manual_seed(0)
        models[name] = GPT(GPTConfig(vocab_size=50257, context_length=cached + new,
                                     n_layer=layers, num_kv_heads=kv)).eval()
    prompt = torch.randint(0, 50257, (1, cached), generator=torch.Generator().manual_seed(0))
    rates = time_decoding(models, dict.fromkeys(models, prompt), new, repeats)
    return {name: (rates[name], model.kv_cache_bytes_per_token())
            for name, model in models.items()}


def time_decoding(models: dict, prompts: dict, new: int, repeats: int) -> dict[str, float]:
    """New tokens/s of greedy one-token steps after each model's prompt (B, P) went through its
    KV cache (not timed); models stepped round-robin, the first round a warm-up, the median."""
    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.inference_mode():
        for i in range(repeats + 1):
            for name, model in models.items():
                caches = model.new_kv_caches(prompts[name].shape[0])
                logits = model(prompts[name], kv_caches=caches, last_only=True)
                token = logits.argmax(-1)  # (B, 1)
                start = clock()
                for _ in range(new):
                    token = model(token, kv_caches=caches, last_only=True).argmax(-1)
                if i:
                    times[name].append(clock() - start)
    return {name: new / max(statistics.median(t), 1e-9) for name, t in times.items()}


def long_generation_memory(variant: str, new_tokens: int) -> dict:
    """In a fresh process: peak extra MiB of generating ``new_tokens`` with a toy-sized rope
    model (``variant``: with or without a window), and the bytes its caches hold."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**LONG, window=LONG_VARIANTS[variant])).eval()
    prompt = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    generate(model, prompt, 8, temperature=0)  # warm-up: lazy initialization, kernel scratch
    peak = peak_extra_mib(lambda: generate(model, prompt, new_tokens, temperature=0))
    cache_bytes = sum(c.nbytes for c in model.new_kv_caches(1))
    return {"peak_mib": peak, "cache_bytes": cache_bytes}


def print_training(lengths, warmup, repeats, threads, memory: bool) -> None:
    header = f"{'T':>5} {'variant':<15} {'fwd+bwd ms':>10} {'vs gpt2':>8} {'peak MiB':>9}"
    print_header(header)
    for T in lengths:
        times = time_training(T, warmup, repeats)
        for variant, t in times.items():
            ratio = statistics.median(b / v for b, v in zip(times["gpt2"], t, strict=True))
            mib = in_subprocess(__file__, ["--measure", variant, "--length", str(T),
                                           "--threads", str(threads)])["peak_mib"] \
                if memory else float("nan")
            print(f"{T:>5} {variant:<15} {statistics.median(t) * 1e3:>10.1f} {ratio:>7.2f}x "
                  f"{mib:>9.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_arguments(parser)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    parser.add_argument("--decode-layers", type=int, default=12)
    parser.add_argument("--cached", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--long", type=int, nargs="+", default=[1, 2, 4],
                        help="generation lengths in multiples of context_length (table 3)")
    parser.add_argument("--tables", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--generate", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    configure_timing(parser, args)
    if args.measure:
        print(json.dumps({"peak_mib": training_memory(args.measure, args.length)}))
        return
    if args.generate:
        print(json.dumps(long_generation_memory(args.generate[0], int(args.generate[1]))))
        return

    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.clock} clock, float32")
    if 1 in args.tables:
        print_training_table(args)
    if 2 in args.tables:
        print_decode_table(args)
    if 3 in args.tables:
        print_long_generation_table(args)


def print_training_table(args) -> None:
    print(f"\n1. One attention layer, {C} dims / {HEADS} heads, batch 1, forward + backward, median "
          f"of {args.repeats} after {args.warmup} warm-up steps")
    print_training(args.lengths, args.warmup, args.repeats, args.threads, not args.no_memory)


def print_decode_table(args) -> None:
    print(f"\n2. Decoding, GPT-2 small shape ({args.decode_layers} layers), {args.new_tokens} "
          f"tokens after {args.cached} cached, median of {args.repeats}")
    rates = decode_rates(args.decode_layers, args.cached, args.new_tokens, args.repeats)
    print_header(f"{'variant':<8} {'tok/s':>8} {'vs gpt2':>8} {'KV bytes/token':>15} {'KV ratio':>9}")
    base_rate, base_bytes = rates["gpt2"]
    for name, (rate, kv_bytes) in rates.items():
        print(f"{name:<8} {rate:>8.1f} {rate / base_rate:>7.2f}x {kv_bytes:>15,} "
              f"{base_bytes / kv_bytes:>8.0f}x")


def print_long_generation_table(args) -> None:
    ctx = LONG["context_length"]
    print(f"\n3. Decoding memory, toy-sized rope models (context {ctx}), each run in its own "
          "process: with a window (ring-buffer caches, no crop) and without (caches of the "
          "context, crop-and-refill)")
    print_header(f"{'variant':<14} {'new tokens':>10} {'x context':>9} {'peak MiB':>9} "
                 f"{'KV cache bytes':>15}")
    for variant in LONG_VARIANTS:
        for multiple in args.long:
            result = in_subprocess(__file__, ["--generate", variant, str(multiple * ctx),
                                              "--threads", str(args.threads)])
            print(f"{variant:<14} {multiple * ctx:>10} {multiple:>9} {result['peak_mib']:>9.2f} "
                  f"{result['cache_bytes']:>15,}", flush=True)

if __name__ == "__main__":
    main()
