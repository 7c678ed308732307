"""``data.batch_size=auto`` on the CPU against a ``trainer.memory_budget``: the size it picks
from the preflight's estimate, and the measured peaks of that size and of its double.

    python -m bench.auto_batch                       # toy model, GPT-2 vocabulary, 1 GiB budget
    python -m bench.auto_batch --case gpt2-small     # GPT-2 small, T=128, 4 GiB budget
    python -m bench.auto_batch --case gpt2-small --budget 3GiB
    python -m bench.auto_batch --quick               # a smaller toy in seconds (a test runs it)
    python -m bench.auto_batch --fits                # the README's table: estimates per GPU size

The choice is ``minigpt.train.plan.choose_from_estimate`` for the plan ``train.py`` would
resolve (CPU, float32, the CPU speedups' chunked loss). Each peak is ``bench.memory``'s: a fresh
process, two of the loop's own training steps, the resident set's peak above its level before
the model was built. Target: the picked size's peak under the budget, its double's above.
"""

from __future__ import annotations

import argparse
import json

from bench.memory import GPT2_SMALL, TOY, measure
from minigpt.config import TrainSchema
from minigpt.train.memory import GiB, estimate_training_memory, largest_that_fits, plan_estimate
from minigpt.train.plan import ESTIMATE_HEADROOM, choose_from_estimate, resolve_plan

PRECISION = "32-true"
# name -> (model, default budget). The budgets leave room for the activations to matter: under
# a budget that weights and optimizer state nearly fill, no micro-batch's double is over it.
CASES = {
    "toy": ({**TOY, "vocab_size": 50304}, "1GiB"),
    "gpt2-small": ({**GPT2_SMALL, "context_length": 128}, "4GiB"),
    "quick": (TOY, "256MiB"),
}


def auto_plan(model: dict, budget: str, cpu_speedups: bool = True):
    """The plan ``train.py`` resolves on this CPU for ``data.batch_size=auto`` under ``budget``."""
    train = TrainSchema()
    train.trainer.accelerator, train.trainer.precision = "cpu", PRECISION
    train.trainer.memory_budget, train.data.batch_size = budget, "auto"
    train.cpu_speedups = "auto" if cpu_speedups else False
    for key in ("n_layer", "n_head", "n_embd", "context_length"):
        setattr(train.model, key, model[key])
    return resolve_plan(train, world_size=1)


def run(model: dict, budget: str, threads: int) -> dict:
    plan = auto_plan(model, budget)
    choice = choose_from_estimate(plan, model)
    rows = []
    for size in (choice.batch_size, 2 * choice.batch_size):
        peak = measure(model, size, PRECISION, plan.chunked_loss, threads)["peak"]
        rows.append({"batch": size, "estimate": plan_estimate(plan, model, size).total,
                     "measured": peak})
    return {"budget": plan.memory_budget, "reason": choice.reason, "rows": rows,
            "met": rows[0]["measured"] <= plan.memory_budget < rows[1]["measured"]}


GPT2_MEDIUM = {**GPT2_SMALL, "n_layer": 24, "n_head": 16, "n_embd": 1024}
CARDS_GIB = (24, 40, 80)
CUDA_OVERHEAD = 1 * GiB  # the CUDA context and the allocator's slack, outside the estimate


def fits_table() -> list[dict]:
    """The largest micro-batch at T=1024 whose bf16-mixed step (plain loss, AdamW) the estimate
    fits on each card, with ``auto``'s headroom, in each activation checkpointing mode."""
    rows = []
    for name, model in (("GPT-2 small", GPT2_SMALL), ("GPT-2 medium", GPT2_MEDIUM)):
        for checkpointing in ("none", "selective", "blocks"):
            sizes = [_largest_on_card(model, checkpointing, gib) for gib in CARDS_GIB]
            rows.append({"model": name, "checkpointing": checkpointing, "sizes": sizes})
    return rows


def _largest_on_card(model: dict, checkpointing: str, gib: int) -> int:
    return largest_that_fits(lambda n: estimate_training_memory(
        model, n, precision="bf16-mixed", activation_checkpointing=checkpointing).total
        * ESTIMATE_HEADROOM <= gib * GiB - CUDA_OVERHEAD, 1024)


def print_fits_table() -> None:
    print("largest micro-batch at T=1024, bf16-mixed, AdamW, by the preflight's estimate "
          f"(+{ESTIMATE_HEADROOM - 1:.0%}, {CUDA_OVERHEAD / GiB:.0f} GiB for CUDA itself)")
    print("| model | activation checkpointing | " + " | ".join(f"{g} GB" for g in CARDS_GIB)
          + " |")
    print("|---|---|" + "---|" * len(CARDS_GIB))
    for r in fits_table():
        print(f"| {r['model']} | {r['checkpointing']} | "
              + " | ".join(str(n) for n in r["sizes"]) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", choices=CASES, default="toy")
    parser.add_argument("--budget", help="trainer.memory_budget (default: the case's)")
    parser.add_argument("--quick", action="store_true", help="--case quick")
    parser.add_argument("--fits", action="store_true", help="estimates per GPU size; no run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    if args.fits:
        print_fits_table()
        return
    model, budget = CASES["quick" if args.quick else args.case]
    budget = args.budget or budget
    result = run(model, budget, args.threads)
    if args.json:
        print(json.dumps(result))
        return
    print(f"trainer.memory_budget={budget} ({result['budget'] / GiB:.2f} GiB): {result['reason']}")
    print(f"{'B':>4} {'estimate GiB':>13} {'measured GiB':>13} {'under budget':>13}")
    for r in result["rows"]:
        print(f"{r['batch']:>4} {r['estimate'] / GiB:>13.2f} {r['measured'] / GiB:>13.2f} "
              f"{'yes' if r['measured'] <= result['budget'] else 'no':>13}")
    print(f"target (picked size under the budget, its double over): "
          f"{'met' if result['met'] else 'NOT met'}")


if __name__ == "__main__":
    main()
