"""Time per training step of each recipe rung on the toy model, as a CPU run of train.py
steps it: the recipe's model with ``minigpt.cpu.speed_up_training`` applied, stepped by the
training loop's own step (``bench.loop_step``: Fabric bf16-mixed, or ``--precision 32-true``,
the recipe's optimizers, AdamW or Muon and AdamW, clipping, the schedule).

    python -m bench.recipe_step                       # gpt2 and modern, all cores
    python -m bench.recipe_step --recipes gpt2 muon blocks modern --threads 1 --clock cpu
    python -m bench.recipe_step --no-cpu-speedups     # the plain models: what minigpt.cpu buys

The rungs are stepped interleaved after warm-up (the compiled blocks compile there), on the same
batch; medians of ``--repeats`` steps and each rung's time against the first rung's. The lab's
runs (``bench/recipe_runs.py``) measure tokens/s over whole runs instead, where the machine's
other load can fall on one run more than another.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from bench.loop_step import loop_step
from bench.recipe_configs import recipe
from bench.timing import (
    add_timing_arguments,
    configure_timing,
    medians,
    print_header,
    time_interleaved,
)
from minigpt.cpu import speed_up_training
from minigpt.model import GPT, GPTConfig

TOY = dict(n_layer=4, n_head=4, n_embd=256, context_length=256, vocab_size=128, dropout=0.0)


def rung_step(name: str, precision: str, cpu_speedups: bool = True):
    """The loop's own training step (``bench.loop_step``) of ``recipe=name`` on the toy model;
    and what the CPU speedups did."""
    options, optim = recipe(name)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TOY, **options)).train()
    applied = speed_up_training(model, precision=precision, keep_freed_memory=False) \
        if cpu_speedups else []
    step = loop_step(model, optim, precision=precision)
    return step, applied


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=["gpt2", "modern"])
    parser.add_argument("--precision", choices=["bf16-mixed", "32-true"], default="bf16-mixed")
    parser.add_argument("--no-cpu-speedups", action="store_true",
                        help="the plain models (as cpu_speedups=false): what minigpt.cpu buys")
    parser.add_argument("--batch", type=int, default=32)
    add_timing_arguments(parser, warmup=3, repeats=10)
    args = parser.parse_args(argv)
    configure_timing(parser, args)
    steps = {}
    for name in args.recipes:
        steps[name], applied = rung_step(name, args.precision, not args.no_cpu_speedups)
        print(f"{name}: {', '.join(applied) or 'no CPU speedups'}")
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, TOY["vocab_size"], (2, args.batch, TOY["context_length"]),
                         generator=gen)
    times = medians(time_interleaved({name: partial(step, x, y) for name, step in steps.items()},
                                     args.warmup, args.repeats))
    base = times[args.recipes[0]]
    print()
    print_header(f"{'recipe':<10} {'ms/step':>9} {'tokens/s':>10} {'vs ' + args.recipes[0]:>9}")
    for name, seconds in times.items():
        print(f"{name:<10} {1e3 * seconds:>9.1f} {x.numel() / seconds:>10,.0f} "
              f"{seconds / base:>8.2f}x")


if __name__ == "__main__":
    main()
