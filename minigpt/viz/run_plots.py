"""Run plots: the ``csv/metrics.csv`` every logging run writes (one row per logging call, blank
cells for metrics not logged then; Lightning's ``CSVLogger`` format) -> one PNG comparing runs.
Logs are found by searching the run directory; ``version_*`` folders merge, later values winning.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# The names a run of train.py logs come first (first match wins); the others cover hand-made logs.
TOKENS = ("tokens", "train/tokens", "tokens_seen")
TRAIN_LOSS = ("train/loss",)
VAL_LOSS = ("val/loss",)
LR = ("lr", "train/lr")
TOKENS_PER_SEC = ("tokens_per_s", "train/tokens_per_s", "tokens_per_sec")
STEP = "step"

FIGSIZE = (16.0, 4.8)  # inches; three panels side by side
DPI = 100


@dataclass
class Run:
    """The numeric metrics of one run: name -> (steps, values), sorted by step."""

    name: str
    sources: list[Path]
    metrics: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def get(self, names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray] | None:
        """The first of ``names`` this run logged, or None."""
        for name in names:
            if name in self.metrics and len(self.metrics[name][0]):
                return self.metrics[name]
        return None

    def tokens_at(self, steps: np.ndarray) -> np.ndarray | None:
        """Tokens seen at ``steps``, interpolated between logged steps and extended linearly
        past either end; None if the run never logged them."""
        series = self.get(TOKENS)
        if series is None:
            return None
        s, t = series
        x = np.interp(steps, s, t)
        if len(s) > 1:
            first = (t[1] - t[0]) / (s[1] - s[0])
            last = (t[-1] - t[-2]) / (s[-1] - s[-2])
        else:  # one point: tokens proportional to steps
            first = last = t[0] / s[0] if s[0] else 0.0
        x = np.where(steps > s[-1], t[-1] + last * (steps - s[-1]), x)
        return np.where(steps < s[0], t[0] + first * (steps - s[0]), x)


def find_logs(run_dir: str | Path) -> list[Path]:
    """The ``metrics.csv`` files under ``run_dir`` (or ``run_dir`` itself, a file); a
    ``ValueError`` when it holds several Hydra runs."""
    root = Path(run_dir)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"run directory {str(root)!r} does not exist")
    hydra_runs = sorted(p.parent for p in root.rglob(".hydra"))
    if len(hydra_runs) > 1:
        shown = ", ".join(str(p) for p in hydra_runs[:4]) + (", ..." if len(hydra_runs) > 4 else "")
        raise ValueError(f"{root} holds {len(hydra_runs)} runs ({shown}); pass each run directory "
                         "you want on the figure")
    csvs = sorted(root.rglob("metrics.csv"), key=_version_order)
    if csvs:
        return csvs
    if any(root.rglob("*.wandb")):  # logger=wandb once wrote wandb's files alone
        raise FileNotFoundError(f"no metrics.csv under {root}, only wandb's run file: minigpt.viz "
                                "plots the CSV log; see this run in wandb (`wandb sync` it) or "
                                "train again with logger=csv")
    raise FileNotFoundError(f"no metrics.csv under {root}; train with logger=csv (or "
                            "logger=wandb) to get one")


def load_run(run_dir: str | Path, name: str | None = None) -> Run:
    """Read every log under ``run_dir`` into one ``Run`` (named after the directory)."""
    merged: dict[str, dict[float, float]] = {}
    sources = find_logs(run_dir)
    for path in sources:
        with open(path, newline="") as f:
            for record in csv.DictReader(f):  # blank cells, and text, are not metrics
                row = {key: _number(text) for key, text in record.items() if key is not None}
                step = row.get(STEP)
                for key, value in row.items():
                    if step is not None and value is not None and key not in (STEP, "epoch"):
                        merged.setdefault(key, {})[step] = value
    run = Run(name or str(run_dir), sources)
    for key, by_step in merged.items():
        steps = np.array(sorted(by_step), dtype=float)
        run.metrics[key] = (steps, np.array([by_step[s] for s in steps], dtype=float))
    return run


def plot_runs(runs: list[Run], path: str | Path, title: str | None = None) -> tuple[int, int]:
    """Write a PNG of train/val loss, learning rate and tokens/s against tokens seen (else
    steps), a colour per run; return its (width, height) in pixels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("no runs to plot")
    by_tokens = all(run.get(TOKENS) is not None for run in runs)
    x_label = "tokens seen" if by_tokens else "step"
    fig, (ax_loss, ax_lr, ax_speed) = plt.subplots(1, 3, figsize=FIGSIZE, dpi=DPI,
                                                   layout="constrained")
    panels = ((ax_loss, "loss"), (ax_lr, "learning rate"), (ax_speed, "tokens/s"))
    drawn = {ax: False for ax, _ in panels}
    for i, run in enumerate(runs):
        color = f"C{i % 10}"

        def draw(ax, names, run=run, color=color, **style):
            series = run.get(names)
            if series is None:
                return
            steps, values = series
            x = run.tokens_at(steps) if by_tokens else steps
            ax.plot(x, values, color=color, **style)
            drawn[ax] = True

        draw(ax_loss, TRAIN_LOSS, label=f"{run.name} train", linewidth=1.2)
        draw(ax_loss, VAL_LOSS, label=f"{run.name} val", linestyle="--", marker="o",
             markersize=3)
        draw(ax_lr, LR, label=run.name)
        draw(ax_speed, TOKENS_PER_SEC, label=run.name)
    for ax, ylabel in panels:
        ax.set_xlabel(x_label)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if drawn[ax]:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return round(FIGSIZE[0] * DPI), round(FIGSIZE[1] * DPI)


def summary(run: Run) -> str:
    """One line per run for the terminal: steps, tokens seen, last train loss, best val loss."""
    parts = [run.name]
    train, val, tokens = run.get(TRAIN_LOSS), run.get(VAL_LOSS), run.get(TOKENS)
    if train is not None:
        parts.append(f"step {int(train[0][-1])}  train/loss {train[1][-1]:.4f}")
    if tokens is not None:
        parts.append(f"tokens {int(tokens[1][-1]):,}")
    if val is not None:
        parts.append(f"best val/loss {np.nanmin(val[1]):.4f}")
    return "  ".join(parts)


def _number(text: str | None) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):  # None, blank or not a number
        return None


def _version_order(path: Path) -> tuple:
    """Sort ``.../version_10/metrics.csv`` after ``.../version_9/metrics.csv``."""
    parts = []
    for part in path.parts:
        tail = part.rsplit("_", 1)[-1]
        parts.append((0, int(tail), part) if tail.isdigit() else (1, 0, part))
    return tuple(parts)
