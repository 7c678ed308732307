"""Decoding with the attention variants: tokens/s and KV-cache bytes after many cached tokens,
and the memory of long generations.

    python -m bench.attention_decoding                        # both tables (~5 min, 2 cores)
    python -m bench.attention_decoding --tables 1 --layers 2 --repeats 1

1. New tokens/s of a GPT-2-small-shaped model (``--layers`` layers) decoding one token at a time
   with ``--cached`` tokens already in the KV cache, 12 (MHA), 4 (GQA) and 1 (MQA) key/value heads,
   timed round-robin after a warm-up (median), and the KV-cache bytes per token.
2. A toy-sized rope + window model generates 1x, 2x and 4x its context_length (each in its own
   process); the peak memory stays flat because the ring-buffer caches hold ``window`` tokens,
   however long the generation. The same model without the window, for comparison, caches its
   whole context and crops and refills it.

Training-step time and memory of the variants: ``python -m bench.attention --variants``.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench.peak_memory import in_subprocess, peak_extra_mib
from bench.timing import add_timing_arguments, clock, configure_timing, print_header
from minigpt.model import GPT, GPTConfig
from minigpt.sampling import generate

DECODE_VARIANTS = {"gpt2": None, "gqa4": 4, "mqa": 1}  # name -> num_kv_heads
LONG = dict(vocab_size=128, context_length=256, n_layer=4, n_head=4, n_embd=256, position="rope")
LONG_VARIANTS = {"rope+window64": 64, "rope": None}  # name -> window


def decode_rates(layers: int, cached: int, new: int, repeats: int,
                 vocab_size: int = 50257) -> dict[str, tuple]:
    """(new tokens/s, KV-cache bytes per token) per grouping, steps timed after the prefill."""
    models = {}
    for name, kv in DECODE_VARIANTS.items():
        torch.manual_seed(0)
        models[name] = GPT(GPTConfig(vocab_size=vocab_size, context_length=cached + new,
                                     n_layer=layers, num_kv_heads=kv)).eval()
    prompt = torch.randint(0, vocab_size, (1, cached), generator=torch.Generator().manual_seed(0))
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
                cache = model.new_kv_cache(prompts[name].shape[0])
                logits = model(prompts[name], kv_cache=cache, last_only=True)
                token = logits.argmax(-1)  # (B, 1)
                start = clock()
                for _ in range(new):
                    token = model(token, kv_cache=cache, last_only=True).argmax(-1)
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
    cache_bytes = model.new_kv_cache(1).nbytes
    return {"peak_mib": peak, "cache_bytes": cache_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_arguments(parser, repeats=5)
    parser.add_argument("--layers", type=int, default=12, help="layers of the decoding model")
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--cached", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--long", type=int, nargs="+", default=[1, 2, 4],
                        help="generation lengths in multiples of context_length (table 2)")
    parser.add_argument("--tables", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    parser.add_argument("--generate", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    configure_timing(parser, args)
    if args.generate:
        print(json.dumps(long_generation_memory(args.generate[0], int(args.generate[1]))))
        return

    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.clock} clock, float32")
    if 1 in args.tables:
        print_decode_table(args)
    if 2 in args.tables:
        print_long_generation_table(args)


def print_decode_table(args) -> None:
    print(f"\n1. Decoding, GPT-2 small shape ({args.layers} layers), {args.new_tokens} "
          f"tokens after {args.cached} cached, median of {args.repeats}")
    rates = decode_rates(args.layers, args.cached, args.new_tokens, args.repeats, args.vocab_size)
    print_header(f"{'variant':<8} {'tok/s':>8} {'vs gpt2':>8} {'KV bytes/token':>15} {'KV ratio':>9}")
    base_rate, base_bytes = rates["gpt2"]
    for name, (rate, kv_bytes) in rates.items():
        print(f"{name:<8} {rate:>8.1f} {rate / base_rate:>7.2f}x {kv_bytes:>15,} "
              f"{base_bytes / kv_bytes:>8.0f}x")


def print_long_generation_table(args) -> None:
    ctx = LONG["context_length"]
    print(f"\n2. Decoding memory, toy-sized rope models (context {ctx}), each run in its own "
          "process: with a window (ring-buffer caches, no crop) and without (caches of the "
          "context, crop-and-refill)")
    print_header(f"{'variant':<14} {'new tokens':>10} {'x context':>9} {'peak MiB':>9} "
                 f"{'KV cache bytes':>15}")
    for variant in LONG_VARIANTS:
        for multiple in args.long:
            result = in_subprocess("bench.attention_decoding", [
                "--generate", variant, str(multiple * ctx), "--threads", str(args.threads)])
            print(f"{variant:<14} {multiple * ctx:>10} {multiple:>9} {result['peak_mib']:>9.2f} "
                  f"{result['cache_bytes']:>15,}", flush=True)

if __name__ == "__main__":
    main()
