"""Measured peak memory of a training step against ``minigpt.train.preflight``'s estimate.

    python -m bench.memory              # the toy and GPT-2 small cases below, CPU
    python -m bench.memory --quick      # the small cases (what tests/train/test_preflight.py runs)

Each case runs in its own process: build the model, apply the CPU speedups when the case uses the
chunked loss (as a CPU run of train.py does), then two of the training loop's own steps
(``bench.loop_step``: train.py's AdamW, clipping; the second has the optimizer state, so it is
the peak); the peak is the process's maximum resident memory above what it held
before the model was built. Prints a table and the worst relative error of the estimate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from minigpt.train.preflight import GiB, estimate_training_memory

ROOT = Path(__file__).resolve().parents[1]  # the checkout
TOY = dict(n_layer=4, n_head=4, n_embd=256, context_length=256, vocab_size=128)
GPT2_SMALL = dict(n_layer=12, n_head=12, n_embd=768, context_length=1024, vocab_size=50304)
# name -> (model, micro-batch, precision, chunked loss); quick cases run in seconds.
CASES = {
    "toy, default run": (TOY, 32, "bf16-mixed", True, "quick"),
    "toy, fp32, plain loss": (TOY, 32, "32-true", False, ""),
    "toy, GPT-2 vocab, bf16, chunked": ({**TOY, "vocab_size": 50304}, 16, "bf16-mixed", True, ""),
    "GPT-2 small, T=128, fp32, plain": ({**GPT2_SMALL, "context_length": 128}, 1, "32-true", False,
                                        "quick"),
    "GPT-2 small, fp32, chunked": (GPT2_SMALL, 2, "32-true", True, ""),
    "GPT-2 small, bf16, chunked": (GPT2_SMALL, 4, "bf16-mixed", True, ""),
    "GPT-2 small, fp32, plain": (GPT2_SMALL, 2, "32-true", False, ""),
}

def probe(model_cfg: dict, batch: int, precision: str, chunked: bool) -> int:
    """In a fresh process: bytes the resident set peaked above its level before the model was
    built, over two of the loop's own training steps (``bench.loop_step``)."""
    import resource

    import torch

    from bench.loop_step import loop_step
    from bench.recipe_configs import optim_settings
    from minigpt.model import GPT, GPTConfig

    torch.manual_seed(0)
    optim = optim_settings()  # composed before the baseline: Hydra's objects are not the step's
    x = torch.randint(0, model_cfg["vocab_size"], (batch, model_cfg["context_length"]))
    base = _rss()
    model = GPT(GPTConfig(**model_cfg))
    if chunked:
        from minigpt.cpu import speed_up_training

        speed_up_training(model, precision=precision, keep_freed_memory=False)
    step = loop_step(model, optim, precision=precision)
    for _ in range(2):  # the second step holds the optimizer state: the peak
        step(x, x)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(model: dict, batch: int, precision: str, chunked: bool, threads: int) -> int:
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "bench.memory", "--probe",
                          json.dumps([model, batch, precision, chunked])],
                         capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"]


def run(quick: bool, threads: int) -> list[dict]:
    rows = []
    for name, (model, batch, precision, chunked, tag) in CASES.items():
        if quick and tag != "quick":
            continue
        estimate = estimate_training_memory(model, batch, precision=precision,
                                            chunked_loss=chunked).total
        peak = measure(model, batch, precision, chunked, threads)
        rows.append({"case": name, "batch": batch, "estimate": estimate, "measured": peak,
                     "error": estimate / peak - 1})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the small cases only")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps({"peak": probe(*json.loads(args.probe))}))
        return
    rows = run(args.quick, args.threads)
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'case':<36} {'B':>3} {'estimate GiB':>13} {'measured GiB':>13} {'error':>7}")
    for r in rows:
        print(f"{r['case']:<36} {r['batch']:>3} {r['estimate'] / GiB:>13.2f} "
              f"{r['measured'] / GiB:>13.2f} {r['error']:>+7.0%}")
    print(f"worst |error|: {max(abs(r['error']) for r in rows):.0%}")


if __name__ == "__main__":
    main()
