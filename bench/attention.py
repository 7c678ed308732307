"""Fused MultiHeadAttention vs the book's unfused one, and the attention variants against
GPT-2's block: forward + backward time and peak memory.

    python -m bench.attention                 # both shapes, all cores, prints a table
    python -m bench.attention --threads 1 --repeats 20
    python -m bench.attention --variants      # grouped-query, rope, window at T = 256 .. 2048

Timing: both variants are built in this process and timed interleaved (book, fused, book, ...)
after warm-up, so machine noise hits both alike; the median of ``--repeats`` steps is reported.
Peak memory: each (shape, variant) runs again in its own fresh subprocess (``--measure-memory``),
see ``measure_memory``. Float32, training mode, dropout 0 (as both would train), one step is
``y = attn(x); y.backward(grad)`` with gradients for the input and all weights. The fused block
runs on PyTorch's default float32 GEMM, as a CPU training run uses it (``minigpt.cpu`` leaves
an attention block's linear layers alone).

``--variants``: one block of GPT-2 small's shape (768 dims, 12 heads, batch 1) per attention
variant (GPT-2's, 4 and 1 key/value heads, rope, a 256-token window, rope + window), with the CPU
speedups, at each of ``--lengths``; timed interleaved, "vs gpt2" the median of per-round ratios,
peak memory of each (variant, T) in its own process.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

from bench.peak_memory import in_subprocess, peak_extra_mib
from bench.timing import (
    add_timing_arguments,
    configure_timing,
    median_ratios,
    medians,
    print_header,
    time_interleaved,
)
from minigpt.attention import MultiHeadAttention
from tests.oracles import BookMultiHeadAttention

SHAPES = {  # name -> (batch, tokens, d_model, heads)
    "8x256x384/6": (8, 256, 384, 6),
    "1x1024x768/12": (1, 1024, 768, 12),
}
VARIANTS = {  # --variants: name -> MultiHeadAttention keywords, at 768 dims and 12 heads
    "gpt2": {},
    "gqa4": {"num_kv_heads": 4},
    "mqa": {"num_kv_heads": 1},
    "rope": {"rope": True},
    "window256": {"window": 256},
    "rope+window256": {"rope": True, "window": 256},
}


def build(variant: str, shape: str, seed: int = 0):
    """The module (train mode, dropout 0), an input that needs a gradient and an output grad.
    ``variant``: "book" or "fused"."""
    B, T, C, nh = SHAPES[shape]
    torch.manual_seed(seed)
    book = BookMultiHeadAttention(C, C, T, 0.0, nh).train()
    module = book
    if variant != "book":
        module = MultiHeadAttention(C, C, T, 0.0, nh).train()
        module.load_state_dict(book.state_dict())  # the same weights, fused
    data = torch.Generator().manual_seed(seed + 1)  # the same inputs for both variants
    x = torch.randn(B, T, C, generator=data).requires_grad_()
    grad = torch.randn(B, T, C, generator=data)
    return module, x, grad


def step(module, x, grad) -> None:
    module.zero_grad(set_to_none=True)
    x.grad = None
    module(x).backward(grad)


def check_equal(shape: str) -> tuple[float, float]:
    """Max abs difference of the two variants' outputs, and of their input gradients (same
    weights, same inputs)."""
    outs = {}
    for variant in ("book", "fused"):
        module, x, grad = build(variant, shape)
        y = module(x)
        y.backward(grad)
        outs[variant] = (y.detach(), x.grad)
    return tuple((a - b).abs().max().item()
                 for a, b in zip(outs["book"], outs["fused"], strict=True))


def time_shapes(shape: str, warmup: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per forward + backward step, per round, variants interleaved."""
    runs = {v: partial(step, *build(v, shape)) for v in ("book", "fused")}
    return time_interleaved(runs, warmup, repeats)


def time_cores(shape: str, warmup: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per round of the attention core alone (q, k, v -> context, forward + backward): the
    part the two variants do differently. The rest of a step is the projections, which both do
    with the same FLOPs (one fused matmul or three)."""
    B, T, C, nh = SHAPES[shape]
    data = torch.Generator().manual_seed(0)
    qkv = [torch.randn(B, nh, T, C // nh, generator=data).requires_grad_() for _ in range(3)]
    grad = torch.randn(B, nh, T, C // nh, generator=data)
    mask = torch.triu(torch.ones(T, T), diagonal=1)  # the book's buffer

    def book(q, k, v):
        scores = (q @ k.transpose(2, 3)).masked_fill_(mask.bool(), -torch.inf)  # (B, nh, T, T)
        return torch.softmax(scores / k.shape[-1] ** 0.5, dim=-1) @ v

    def fused(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def core_step(core):
        for t in qkv:
            t.grad = None
        core(*qkv).backward(grad)

    return time_interleaved({"book": partial(core_step, book), "fused": partial(core_step, fused)},
                            warmup, repeats)


def _summary(times: dict[str, list[float]]) -> tuple[dict[str, float], dict[str, float]]:
    """Median time per variant, and per variant the median of per-round book / variant ratios."""
    return medians(times), median_ratios(times, "book")


def measure_memory(variant: str, shape: str | int) -> float:
    """Peak extra resident memory (MiB) of one forward + backward step, in this (fresh) process
    (see ``peak_memory``): after a warm-up step (lazy initialization, kernel scratch) and with the
    gradients freed, what the step needs on top of the weights and the input (activations saved
    for backward, scores, gradients). ``shape``: a ``SHAPES`` name, or T for ``VARIANTS``."""
    module, x, grad = build_variant(variant, shape) if variant in VARIANTS else \
        build(variant, shape)
    step(module, x, grad)
    module.zero_grad(set_to_none=True)
    x.grad = None
    return peak_extra_mib(lambda: step(module, x, grad))


def memory_in_subprocess(variant: str, shape: str | int, threads: int) -> float:
    return in_subprocess("bench.attention", ["--measure-memory", variant, "--shape", str(shape),
                                    "--threads", str(threads)])["peak_mib"]


def build_variant(variant: str, T: int, seed: int = 0):
    """A GPT-2-small-shaped block of ``VARIANTS[variant]`` for T tokens, an input that needs a
    gradient and an output gradient."""
    torch.manual_seed(seed)
    module = MultiHeadAttention(768, 768, T, 0.0, 12, True, **VARIANTS[variant]).train()
    data = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, T, 768, generator=data).requires_grad_()
    return module, x, torch.randn(1, T, 768, generator=data)


def print_variants(args) -> None:
    """The variants table: time and peak memory per (T, variant), ratios against gpt2."""
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.clock} clock, float32, "
          f"forward + backward, 768 dims / 12 heads, batch 1, median of {args.repeats} after "
          f"{args.warmup} warm-up steps\n")
    print_header(f"{'T':>5} {'variant':<15} {'fwd+bwd ms':>10} {'vs gpt2':>8} {'peak MiB':>9} "
                 f"{'mem vs gpt2':>11}")
    for T in args.lengths:
        runs = {v: partial(step, *build_variant(v, T)) for v in VARIANTS}
        times = time_interleaved(runs, args.warmup, args.repeats)
        mem = {v: memory_in_subprocess(v, T, args.threads) for v in runs}
        ratios = median_ratios(times, "gpt2")
        for variant, t in medians(times).items():
            print(f"{T:>5} {variant:<15} {t * 1e3:>10.1f} {ratios[variant]:>7.2f}x "
                  f"{mem[variant]:>9.1f} {mem[variant] / mem['gpt2']:>10.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_arguments(parser, warmup=3, repeats=10)
    parser.add_argument("--shape", action="append",
                        help=f"shape(s) to run, of {', '.join(SHAPES)} (default: all)")
    parser.add_argument("--variants", action="store_true",
                        help="time the attention variants instead (see the docstring)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048],
                        help="--variants: sequence lengths (default: 256 512 1024 2048)")
    parser.add_argument("--measure-memory", help=argparse.SUPPRESS)
    args = parser.parse_args()
    configure_timing(parser, args)

    if args.measure_memory:
        shape = args.shape[0]
        peak = measure_memory(args.measure_memory, int(shape) if shape.isdigit() else shape)
        print(json.dumps({"peak_mib": peak}))
        return
    if args.variants:
        print_variants(args)
        return
    unknown = [s for s in args.shape or [] if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {unknown}; choose from {', '.join(SHAPES)}")

    shapes = args.shape or list(SHAPES)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.clock} clock, float32, "
          "forward + backward, "
          f"median of {args.repeats} after {args.warmup} warm-up steps\n")
    header = (f"{'shape (B x T x C / heads)':<26} {'book ms':>9} {'fused ms':>9} {'speedup':>8} "
              f"{'book MiB':>9} {'fused MiB':>10} {'mem ratio':>10} {'out diff':>9} {'grad diff':>9}")
    print_header(header)
    block_times = {}
    for shape in shapes:
        out_diff, grad_diff = check_equal(shape)
        t, speedup = _summary(time_shapes(shape, args.warmup, args.repeats))
        block_times[shape] = t
        mem = {v: memory_in_subprocess(v, shape, args.threads) for v in ("book", "fused")}
        print(f"{shape:<26} {t['book'] * 1e3:>9.1f} {t['fused'] * 1e3:>9.1f} "
              f"{speedup['fused']:>7.2f}x {mem['book']:>9.1f} {mem['fused']:>10.1f} "
              f"{mem['fused'] / mem['book']:>9.2f}x {out_diff:>9.1e} {grad_diff:>9.1e}")
    print("\nspeedup = median over rounds of book time / fused time (adjacent steps); "
          "mem ratio = fused peak / book peak\n(peak resident memory of one step above the "
          "baseline, each variant in its own process)\nout diff / grad diff = max abs difference "
          "of the outputs / input gradients (same weights and inputs)")

    print("\nThe attention core alone (q, k, v -> context; forward + backward), where the variants "
          "differ:\n")
    header = (f"{'shape (B x T x C / heads)':<26} {'book ms':>9} {'SDPA ms':>9} {'speedup':>8} "
              f"{'block time in projections (fused)':>34}")
    print_header(header)
    for shape in shapes:
        core, speedup = _summary(time_cores(shape, args.warmup, args.repeats))
        block = block_times[shape]["fused"]
        print(f"{shape:<26} {core['book'] * 1e3:>9.1f} {core['fused'] * 1e3:>9.1f} "
              f"{speedup['fused']:>7.2f}x {max(0.0, 1 - core['fused'] / block):>33.0%}")


if __name__ == "__main__":
    main()
