"""Float32 GEMM speed on this CPU: PyTorch's default (MKL) vs oneDNN (``minigpt.cpu.linear``).

    python -m bench.gemm                 # the model's linear-layer shapes, all cores
    python -m bench.gemm --threads 1

For each (rows, in, out) of the toy and GPT-2-small training steps, times a linear layer's three
matmuls: forward ``x @ W.T``, input gradient ``dy @ W`` and weight gradient ``dy.T @ x``, with
``torch.mm`` on the same strided views as ``F.linear``'s autograd, and with the oneDNN calls
``minigpt.cpu.linear.OneDNNLinear`` makes (the layer ``minigpt.cpu.speed_up_training`` swaps
in). Medians of ``--repeats`` calls after warm-up, both kernels timed interleaved; also the max
abs difference of each oneDNN result from float64 math next to MKL's, so a faster path that
loses precision would show. "applied" is what ``speed_up_training`` picks for that matmul of a
layer of that shape on this machine (``minigpt.cpu.tuning``: its short start-up measurement, or
the timings file it left), with the ratio that start-up measurement took it on ("start-up ratio",
oneDNN / MKL at 512 rows): a row with "oneDNN" there and a ratio below 1 would be a speedup that
slows this CPU down.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from torch import nn

from bench.timing import add_timing_arguments, clock, configure_timing, print_header
from minigpt.cpu.linear import matmul_kernels, measure_matmuls, timed_shape, train_key
from minigpt.cpu.onednn import available as onednn_available
from minigpt.cpu.tuning import KernelChoices, pick

SHAPES = {  # rows (batch x tokens), in, out
    "toy qkv": (2048, 384, 1152),
    "toy mlp fc": (2048, 384, 1536),
    "toy mlp proj": (2048, 1536, 384),
    "toy lm head": (512, 384, 50304),  # one chunk of the loss
    "small qkv": (1024, 768, 2304),
    "small mlp fc": (1024, 768, 3072),
    "small mlp proj": (1024, 3072, 768),
    "small lm head": (512, 768, 50304),
}


def interleaved_seconds(kernels: dict, warmup: int, repeats: int) -> dict[str, float]:
    """Median seconds per call of each kernel, the kernels called in turn so load hits all."""
    for kernel in kernels.values():
        for _ in range(warmup):
            kernel()
    times = {name: [] for name in kernels}
    for _ in range(repeats):
        for name, kernel in kernels.items():
            start = clock()
            kernel()
            times[name].append(clock() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def matmuls(x, w, dy) -> dict:
    """A linear layer's three matmuls: name -> (MKL call, oneDNN call, float64 reference)."""
    exact = {
        "forward": lambda: x.double() @ w.double().t(),
        "input grad": lambda: dy.double() @ w.double(),
        "weight grad": lambda: dy.double().t() @ x.double(),
    }
    return {name: (pair["mkl"], pair["onednn"], exact[name])
            for name, pair in matmul_kernels(x, w, dy).items()}


def applied_kernel(d_in: int, d_out: int, matmul: str) -> tuple[str, str]:
    """The kernel ``speed_up_training`` uses for ``matmul`` of an (in, out) layer here, and
    why: its start-up measurement's ratio (oneDNN / MKL speed), cached or measured now."""
    layer = nn.Linear(d_in, d_out, bias=False, device="meta")
    key = train_key(layer, matmul)
    timings, cached = KernelChoices().timings(
        [key], lambda keys: measure_matmuls({key: timed_shape(layer, matmul)}), "mkl")
    choice = pick(timings[key], "mkl", key in cached)
    kernel = "oneDNN" if choice.kernel == "onednn" else "MKL"
    return kernel, f"x{choice.ratio:.2f} {'cached' if choice.cached else 'measured'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_arguments(parser)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    configure_timing(parser, args)
    if not onednn_available():
        sys.exit("oneDNN's linear op is not available in this PyTorch: nothing to compare")

    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.clock} clock, float32, "
          f"median of {args.repeats}\n")
    header = (f"{'shape':<15} {'rows x in x out':>18} {'matmul':<12} {'MKL GFLOP/s':>11} "
              f"{'oneDNN':>7} {'ratio':>6} {'applied':>7} {'start-up ratio':>16} "
              f"{'MKL err':>8} {'oneDNN err':>10}")
    print_header(header)
    generator = torch.Generator().manual_seed(0)
    for name, (n, d_in, d_out) in SHAPES.items():
        x = torch.randn(n, d_in, generator=generator)
        w = torch.randn(d_out, d_in, generator=generator)
        dy = torch.randn(n, d_out, generator=generator)
        pairs = matmuls(x, w, dy)
        flops = 2 * n * d_in * d_out
        for matmul, (mkl, onednn, exact) in pairs.items():
            reference = exact()
            errors = [(f().double() - reference).abs().max().item() for f in (mkl, onednn)]
            seconds = interleaved_seconds({"mkl": mkl, "onednn": onednn}, args.warmup,
                                          args.repeats)
            rate = {k: flops / t / 1e9 for k, t in seconds.items()}
            kernel, why = applied_kernel(d_in, d_out, matmul)
            print(f"{name:<15} {f'{n}x{d_in}x{d_out}':>18} {matmul:<12} {rate['mkl']:>11.0f} "
                  f"{rate['onednn']:>7.0f} {rate['onednn'] / rate['mkl']:>5.2f}x {kernel:>7} "
                  f"{why:>16} {errors[0]:>8.1e} {errors[1]:>10.1e}")
    print("\nerr = max abs difference from the float64 product (operands ~N(0, 1))")


if __name__ == "__main__":
    main()
