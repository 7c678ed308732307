"""The attention lab's table and picture: one row per run of ``experiment=attention_variants``.

    python train.py -m experiment=attention_variants          # one toy run per attention variant
    python -m bench.attention_runs outputs/attention_variants/<time> --out attention_runs.png

Give run directories (Hydra's: ``config.yaml``, ``summary.json``, ``checkpoints/last.ckpt`` and
``csv/metrics.csv``) or a sweep directory holding them (in the order they finished). Per run:

* final val/loss (``summary.json``) and its difference from the baseline run (``--baseline``:
  the run named gpt2, else the first); the table says which runs miss it by more than
  ``--tolerance`` (0.05) and by how much;
* training tokens/s: the median of the logged ``tokens_per_s`` over the second half of the run;
* decode tokens/s: greedy one-token steps with the KV cache after a ``--cached``-token prompt
  (default half the context), every run's model in this process, timed round-robin after a
  warm-up, median of ``--repeats``; the prompt's forward pass is not counted;
* KV-cache bytes per cached token (float32) and the cache's size at the full context (a window
  bounds it);
* peak memory of one float32 training step at the run's batch size and context, with the CPU
  speedups training uses, each run in its own process (``peak_memory.py``).

The picture: validation loss against tokens seen, and one bar chart per other column.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import runs as lab
from bench.attention_decoding import time_decoding
from bench.peak_memory import in_subprocess, peak_extra_mib
from minigpt.checkpoint import load_checkpoint
from minigpt.viz.run_plots import TOKENS_PER_SEC, VAL_LOSS, load_run


@dataclass
class Row:
    name: str
    attention: str
    params: int
    val_loss: float | None
    train_tok_s: float | None
    decode_tok_s: float = float("nan")
    kv_bytes_per_token: int = 0
    kv_bytes_at_context: int = 0
    train_peak_mib: float = float("nan")


def describe(config) -> str:
    """The attention block of a model config in a few words."""
    parts = [f"{config.kv_heads}/{config.n_head} kv heads", config.position]
    if config.window is not None:
        parts.append(f"window {config.window}")
    return ", ".join(parts)


def read_run(run_dir: Path, name: str):
    """(Row without the measured columns, model, run's training batch size, Run of metrics)."""
    model, _, _ = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    run = load_run(run_dir, name)
    train_tok_s = lab.late_median(run.get(TOKENS_PER_SEC))
    c = model.config
    val_loss = lab.summary(run_dir).get("val_loss")
    row = Row(name, describe(c), model.num_params(), val_loss, train_tok_s,
              kv_bytes_per_token=model.kv_cache_bytes_per_token(torch.float32))
    row.kv_bytes_at_context = row.kv_bytes_per_token * min(c.context_length, c.window or 10**9)
    return row, model, _batch_size(run_dir), run


def _batch_size(run_dir: Path) -> int:
    from omegaconf import OmegaConf

    return int(OmegaConf.load(run_dir / "config.yaml").data.batch_size)


def decode_rates(models: dict, cached: int | None, new_tokens: int, repeats: int) -> dict:
    """New tokens/s of cached greedy decoding per model after a prompt of ``cached`` tokens
    (default: half the context, leaving room for the new ones)."""
    prompts = {}
    for name, model in models.items():
        ctx = model.config.context_length
        P = max(1, min(cached or ctx // 2, ctx - new_tokens))
        prompts[name] = torch.randint(0, model.config.vocab_size, (1, P),
                                      generator=torch.Generator().manual_seed(0))
    return time_decoding(models, prompts, new_tokens, repeats)


def train_step_peak_mib(ckpt: Path, batch_size: int) -> float:
    """Run in a fresh process (see ``peak_memory``): one float32 training step's extra MiB."""
    import minigpt.cpu

    model, _, _ = load_checkpoint(ckpt)
    model.train()
    minigpt.cpu.speed_up_training(model, keep_freed_memory=False)
    T = model.config.context_length
    data = torch.randint(0, model.config.vocab_size, (batch_size, T + 1),
                         generator=torch.Generator().manual_seed(0))

    def step():
        model.zero_grad(set_to_none=True)
        model.loss(data[:, :-1], data[:, 1:]).backward()

    step()
    model.zero_grad(set_to_none=True)
    return peak_extra_mib(step)


def format_table(rows: list[Row], baseline: Row, tolerance: float) -> str:
    """A Markdown table, then one line on the val/loss target."""
    lines = ["| run | attention | params | val/loss | vs " + baseline.name + " | train tok/s | "
             "decode tok/s | KV bytes/token | KV cache at context | train-step peak MiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        delta = _delta(r, baseline)
        lines.append(
            f"| {r.name} | {r.attention} | {r.params / 1e6:.2f}M | {lab.cell(r.val_loss, '.3f')} | "
            f"{lab.cell(delta, '+.3f')} | {lab.cell(r.train_tok_s, ',.0f')} | "
            f"{lab.cell(r.decode_tok_s, ',.0f')} | {r.kv_bytes_per_token:,} | "
            f"{r.kv_bytes_at_context / 1024:,.0f} KiB | {lab.cell(r.train_peak_mib, '.1f')} |")
    misses = [f"{r.name} (+{_delta(r, baseline):.3f})" for r in rows
              if _delta(r, baseline) is not None and _delta(r, baseline) > tolerance]
    lines.append("")
    lines.append(f"val/loss within {tolerance} of {baseline.name}: "
                 + (f"all runs except {', '.join(misses)}" if misses else "every run"))
    return "\n".join(lines)


def _delta(row: Row, baseline: Row) -> float | None:
    if row.val_loss is None or baseline.val_loss is None:
        return None
    return row.val_loss - baseline.val_loss


def plot(rows: list[Row], runs: list, path: Path) -> None:
    """Validation loss against tokens seen, and a bar chart per measured column."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = (("train tok/s", "train_tok_s"), ("decode tok/s", "decode_tok_s"),
            ("KV-cache bytes/token", "kv_bytes_per_token"), ("train-step peak MiB",
                                                              "train_peak_mib"))
    fig, axes = plt.subplots(1, 1 + len(bars), figsize=(20, 4.2), dpi=90, layout="constrained")
    colors = [f"C{i % 10}" for i in range(len(rows))]
    by_tokens = all(run.tokens_at(run.get(VAL_LOSS)[0]) is not None for run in runs
                    if run.get(VAL_LOSS) is not None)
    for run, color in zip(runs, colors, strict=True):
        series = run.get(VAL_LOSS)
        if series is not None:
            steps, values = series
            x = run.tokens_at(steps) if by_tokens else steps
            axes[0].plot(x, values, marker="o", markersize=3, color=color, label=run.name)
    axes[0].set(title="val/loss", xlabel="tokens seen" if by_tokens else "step")
    axes[0].legend(fontsize=7)
    axes[0].grid(alpha=0.3)
    names = [r.name for r in rows]
    for ax, (title, field) in zip(axes[1:], bars, strict=True):
        values = [getattr(r, field) or 0.0 for r in rows]
        ax.bar(names, values, color=colors)
        ax.set_title(title)
        ax.tick_params(axis="x", labelrotation=45, labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    lab.add_run_arguments(parser, out="attention_runs.png", at_least_one=False)
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--cached", type=int, help="prompt tokens before decoding (default: "
                        "half the context)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--measure-memory", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.measure_memory:
        print(json.dumps({"peak_mib": train_step_peak_mib(args.measure_memory, args.batch_size)}))
        return
    if not args.run_dirs:
        parser.error("name at least one run directory")
    rows, models, runs = [], {}, []
    for run_dir, name in lab.labelled_runs(parser, args.run_dirs, args.labels):
        row, models[name], batch_size, run = read_run(run_dir, name)
        row.train_peak_mib = in_subprocess("bench.attention_runs", [
            "--measure-memory", str(run_dir / "checkpoints" / "last.ckpt"),
            "--batch-size", str(batch_size), "--threads", str(args.threads)])["peak_mib"]
        rows.append(row)
        runs.append(run)
    for row, rate in zip(rows, decode_rates(models, args.cached, args.new_tokens,
                                            args.repeats).values(), strict=True):
        row.decode_tok_s = rate
    print(format_table(rows, lab.baseline_row(rows, args.baseline), args.tolerance))
    plot(rows, runs, args.out)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
