"""Measured peak memory of a training step against ``minigpt.train.memory``'s estimate, and
what activation checkpointing saves and costs.

    python -m bench.memory              # the toy and GPT-2 small cases below, CPU
    python -m bench.memory --quick      # the small cases (what tests/train/test_preflight.py runs)
    python -m bench.memory --modes      # GPT-2 small, T=1024, float32: B 1, 2, 4 x each
                                        # trainer.activation_checkpointing mode (issue 31)
    python -m bench.memory --modes --batches 2 --splits   # + selective's other split

Each measurement runs in its own process, with glibc's mmap threshold fixed so that freed
tensors leave the resident set (``bench.peak_memory``): build the model, checkpoint its blocks in the case's
mode, apply the CPU speedups when the case uses the chunked loss (as a CPU run of train.py
does), then two of the training loop's own steps (``bench.loop_step``: train.py's AdamW,
clipping; the second has the optimizer state, so holds the peak); the peak is the process's
maximum resident memory above what it held before the model was built, the step time the
second step's. ``--modes`` also measures the same step on one token (weights,
gradients, AdamW state: no activations to speak of) and prints each row's activation memory as
its peak above that baseline, with the cut and the step-time ratio against ``none`` at the same B.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from bench.peak_memory import in_subprocess
from minigpt.train.activation_checkpointing import ATTENTION_OPS, SELECTIVE_SAVES
from minigpt.train.memory import GiB, estimate_training_memory

TOY = dict(n_layer=4, n_head=4, n_embd=256, context_length=256, vocab_size=128)
GPT2_SMALL = dict(n_layer=12, n_head=12, n_embd=768, context_length=1024, vocab_size=50304)
# name -> (model, micro-batch, precision, chunked loss, tag[, checkpointing]); quick: seconds.
CASES = {
    "toy, default run": (TOY, 32, "bf16-mixed", True, "quick"),
    "toy, fp32, plain loss": (TOY, 32, "32-true", False, ""),
    "toy, GPT-2 vocab, bf16, chunked": ({**TOY, "vocab_size": 50304}, 16, "bf16-mixed", True, ""),
    "GPT-2 small, T=128, fp32, plain": ({**GPT2_SMALL, "context_length": 128}, 1, "32-true", False,
                                        "quick"),
    "GPT-2 small, fp32, chunked": (GPT2_SMALL, 2, "32-true", True, ""),
    "GPT-2 small, bf16, chunked": (GPT2_SMALL, 4, "bf16-mixed", True, ""),
    "GPT-2 small, fp32, plain": (GPT2_SMALL, 2, "32-true", False, ""),
    **{f"toy, fp32, chunked, {mode}": (TOY, 16, "32-true", True, "quick", mode)
       for mode in ("none", "selective", "blocks")},
}
# --modes: the row name -> (trainer.activation_checkpointing, the ops selective keeps)
MODES = {"none": ("none", ()), "blocks": ("blocks", ()),
         "selective": ("selective", SELECTIVE_SAVES)}
SPLITS = {"selective, attention only": ("selective", ATTENTION_OPS)}


def probe(model_cfg: dict, batch: int, precision: str, chunked: bool, threads: int,
          mode: str = "none", saved_ops: list | None = None, tokens: int | None = None) -> dict:
    """In a fresh process: bytes the resident set peaked above its level before the model was
    built over two of the loop's own training steps (``bench.loop_step``) of ``batch`` rows
    of ``tokens`` (default: the context), and the second step's seconds."""
    import resource

    import torch

    torch.set_num_threads(threads)
    from bench.loop_step import loop_step
    from bench.recipe_configs import optim_settings
    from minigpt.model import GPT, GPTConfig
    from minigpt.train.activation_checkpointing import apply_activation_checkpointing

    torch.manual_seed(0)
    optim = optim_settings()  # composed before the baseline: Hydra's objects are not the step's
    x = torch.randint(0, model_cfg["vocab_size"], (batch, tokens or model_cfg["context_length"]))
    base = _rss()
    model = GPT(GPTConfig(**model_cfg))
    apply_activation_checkpointing(model, mode, tuple(saved_ops or SELECTIVE_SAVES))
    if chunked:
        from minigpt.cpu import speed_up_training

        speed_up_training(model, precision=precision, keep_freed_memory=False)
    step = loop_step(model, optim, precision=precision)
    seconds = []
    for _ in range(2):  # the second holds the optimizer state: the peak
        start = time.perf_counter()
        float(step(x, x))  # read back: the step is done
        seconds.append(time.perf_counter() - start)
    return {"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base,
            "seconds": seconds[-1]}


def _rss() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(model: dict, batch: int, precision: str, chunked: bool, threads: int,
            mode: str = "none", saved_ops: tuple = (), tokens: int | None = None) -> dict:
    """``probe`` in a fresh process whose freed tensors leave the resident set
    (``bench.peak_memory.in_subprocess``), so its peak is that of the live tensors."""
    return in_subprocess("bench.memory", ["--probe", json.dumps(
        [model, batch, precision, chunked, threads, mode, list(saved_ops), tokens])])


def run(quick: bool, threads: int) -> list[dict]:
    rows = []
    for name, (model, batch, precision, chunked, tag, *mode) in CASES.items():
        if quick and tag != "quick":
            continue
        mode = mode[0] if mode else "none"
        estimate = estimate_training_memory(model, batch, precision=precision,
                                            chunked_loss=chunked,
                                            activation_checkpointing=mode).total
        peak = measure(model, batch, precision, chunked, threads, mode,
                       MODES[mode][1])["peak"]
        rows.append({"case": name, "batch": batch, "mode": mode, "estimate": estimate,
                     "measured": peak, "error": estimate / peak - 1})
    return rows


def run_modes(batches: list[int], threads: int, splits: bool) -> list[dict]:
    """GPT-2 small, T=1024, float32, chunked loss (a CPU run of train.py): each B x mode."""
    model, precision = GPT2_SMALL, "32-true"
    baseline = measure(model, 1, precision, True, threads, tokens=1)["peak"]
    variants = {**MODES, **(SPLITS if splits else {})}
    rows = []
    for batch in batches:
        for name, (mode, saved) in variants.items():
            got = measure(model, batch, precision, True, threads, mode, saved)
            estimate = estimate_training_memory(model, batch, precision=precision,
                                                chunked_loss=True,
                                                activation_checkpointing=mode).total \
                if name in MODES else None
            rows.append({"batch": batch, "mode": name, "measured": got["peak"],
                         "activations": got["peak"] - baseline, "estimate": estimate,
                         "error": None if estimate is None else estimate / got["peak"] - 1,
                         "seconds": got["seconds"], "baseline": baseline})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress, row by row
    for row in rows:
        none = next(r for r in rows if r["batch"] == row["batch"] and r["mode"] == "none")
        row["cut"] = 1 - row["activations"] / none["activations"]
        row["time_ratio"] = row["seconds"] / none["seconds"]
    return rows


def _print_modes(rows: list[dict]) -> None:
    print(f"baseline (one token: weights, gradients, AdamW state): "
          f"{rows[0]['baseline'] / GiB:.2f} GiB")
    print(f"{'B':>2} {'mode':<26} {'peak GiB':>9} {'activ. GiB':>10} {'cut':>5} "
          f"{'estimate':>9} {'error':>6} {'step s':>7} {'x none':>7}")
    for r in rows:
        estimate = "-" if r["estimate"] is None else f"{r['estimate'] / GiB:.2f}"
        error = "-" if r["error"] is None else f"{r['error']:+.0%}"
        print(f"{r['batch']:>2} {r['mode']:<26} {r['measured'] / GiB:>9.2f} "
              f"{r['activations'] / GiB:>10.2f} {r['cut']:>5.0%} {estimate:>9} {error:>6} "
              f"{r['seconds']:>7.2f} {r['time_ratio']:>7.2f}")
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    print(f"worst |error| of the estimate: {max(errors):.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the small cases only")
    parser.add_argument("--modes", action="store_true",
                        help="GPT-2 small, T=1024: each activation checkpointing mode")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4],
                        help="--modes: the micro-batches")
    parser.add_argument("--splits", action="store_true",
                        help="--modes: also selective keeping the attention output only")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(*json.loads(args.probe))))
        return
    if args.modes:
        rows = run_modes(args.batches, args.threads, args.splits)
        print(json.dumps(rows)) if args.json else _print_modes(rows)
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
