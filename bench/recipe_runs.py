"""The recipe lab's table and picture: one row per run of ``experiment=recipe_lab``.

    python train.py -m experiment=recipe_lab                  # one toy run per recipe rung
    python -m bench.recipe_runs outputs/recipe_lab/<time> --out recipe_runs.png

Give run directories or a sweep directory holding them (see ``attention_runs.py``). Per run:
parameters, final val/loss, the first validated step at or below the baseline's final val/loss
(``--baseline``: the run named gpt2, else the first) as steps and as a share of the baseline's
steps (also interpolated between the validations around it), training tokens/s (median of the second half of the logged values) and time per step
against the baseline's. The picture: val/loss against steps, and tokens/s per run.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from bench import runs as lab
from minigpt.checkpoint import load_checkpoint
from minigpt.viz.run_plots import TOKENS_PER_SEC, VAL_LOSS, load_run


@dataclass
class Row:
    name: str
    params: int
    val_loss: float | None
    steps: int
    val_steps: list  # validated steps
    val_losses: list
    train_tok_s: float | None

    def first_step_at_or_below(self, loss: float) -> int | None:
        return next((int(s) for s, v in zip(self.val_steps, self.val_losses, strict=True)
                     if v <= loss), None)

    def interpolated_crossing(self, loss: float) -> float | None:
        """The step where val/loss first reaches ``loss``, read off the straight line between
        the validations on either side (finer than the validation interval)."""
        before = None
        for step, value in zip(self.val_steps, self.val_losses, strict=True):
            if value <= loss:
                if before is None:
                    return float(step)
                (step0, value0) = before
                return step0 + (value0 - loss) / (value0 - value) * (step - step0)
            before = (step, value)
        return None


def read_run(run_dir: Path, name: str) -> Row:
    model, _, _ = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    result = lab.summary(run_dir)
    run = load_run(run_dir, name)
    val = run.get(VAL_LOSS)
    return Row(name, model.num_params(), result.get("val_loss"), int(result["steps"]),
               list(val[0]) if val else [], list(val[1]) if val else [],
               lab.late_median(run.get(TOKENS_PER_SEC)))


def format_table(rows: list[Row], baseline: Row) -> str:
    target = baseline.val_loss
    lines = [f"| run | params | val/loss | steps to {baseline.name}'s {target:.4f} | share of "
             f"{baseline.name}'s steps | interpolated share | train tok/s | time per step vs "
             f"{baseline.name} |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        reached = r.first_step_at_or_below(target) if target is not None else None
        share = reached / baseline.steps if reached else None
        crossing = r.interpolated_crossing(target) if target is not None else None
        between = crossing / baseline.steps if crossing is not None else None
        slow = baseline.train_tok_s / r.train_tok_s if r.train_tok_s and baseline.train_tok_s \
            else None
        lines.append(f"| {r.name} | {r.params / 1e6:.2f}M | {lab.cell(r.val_loss, '.4f')} | "
                     f"{reached if reached else 'not reached'} | {lab.cell(share, '.0%')} | "
                     f"{lab.cell(between, '.1%')} | {lab.cell(r.train_tok_s, ',.0f')} | "
                     f"{lab.cell(slow, '.2f')}x |")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, speed_ax) = plt.subplots(1, 2, figsize=(12, 4.2), dpi=90,
                                            layout="constrained")
    for i, r in enumerate(rows):
        loss_ax.plot(r.val_steps, r.val_losses, marker="o", markersize=3, color=f"C{i % 10}",
                     label=r.name)
    loss_ax.set(title="val/loss", xlabel="step")
    loss_ax.legend(fontsize=8)
    loss_ax.grid(alpha=0.3)
    speed_ax.bar([r.name for r in rows], [r.train_tok_s or 0.0 for r in rows],
                 color=[f"C{i % 10}" for i in range(len(rows))])
    speed_ax.set_title("train tok/s")
    speed_ax.grid(axis="y", alpha=0.3)
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    lab.add_run_arguments(parser, out="recipe_runs.png")
    args = parser.parse_args(argv)
    rows = [read_run(d, name) for d, name in lab.labelled_runs(parser, args.run_dirs, args.labels)]
    print(format_table(rows, lab.baseline_row(rows, args.baseline)))
    plot(rows, args.out)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
