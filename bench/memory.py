"""Measured peak memory of a training step against ``minigpt.train.preflight``'s estimate.

    python -m bench.memory              # the toy and GPT-2 small cases below, CPU
    python -m bench.memory --quick      # the small cases only (what tests/train/test_preflight.py runs)

Each case runs in its own process: build the model, apply the CPU speedups when the case uses the
chunked loss (as a CPU run of train.py does), then two AdamW steps (the second has the optimizer
state, so it is the peak); the peak is the process's maximum resident memory above what it held
before the model was built. Prints a table and the worst relative error of the estimate.
"""

from __future__ import annotations

import argparse
import json
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

PROBE = r"""
import json, os, resource, sys, torch
from minigpt.model import GPT, GPTConfig
model_cfg, batch, precision, chunked = json.loads(sys.argv[1])
torch.manual_seed(0)
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
x = torch.randint(0, model_cfg["vocab_size"], (batch, model_cfg["context_length"]))
base = rss()
model = GPT(GPTConfig(**model_cfg))
if chunked:
    from minigpt.cpu import speed_up_training
    speed_up_training(model, precision=precision, keep_freed_memory=False)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
for _ in range(2):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        loss = model.loss(x, x)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(json.dumps({"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base}))
"""


def measure(model: dict, batch: int, precision: str, chunked: bool, threads: int) -> int:
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps([model, batch, precision,
                                                                    chunked])],
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
    args = parser.parse_args()
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
