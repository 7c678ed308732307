"""What the lab tables (``bench.attention_runs``, ``bench.recipe_runs``) share: their command
line, the run directories of a sweep, what each run logged and the cells of a Markdown table."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def add_run_arguments(parser: argparse.ArgumentParser, out: str, at_least_one: bool = True) -> None:
    """RUN_DIR..., ``--labels``, ``--baseline`` (default: the run named gpt2, else the first) and
    ``--out`` (the picture, default ``out``)."""
    parser.add_argument("run_dirs", nargs="+" if at_least_one else "*", type=Path,
                        metavar="RUN_DIR", help="run directories, or sweep directories of runs")
    parser.add_argument("--labels", nargs="+", help="names, one per run (default: directory names)")
    parser.add_argument("--baseline", help="the run the others are measured against (default: "
                        "gpt2, else the first)")
    parser.add_argument("--out", type=Path, default=Path(out), help=f"the picture (default {out})")


def expand_runs(paths: list[Path]) -> list[Path]:
    """Run directories: each path that is one, and the runs inside each path that is a sweep."""
    runs = []
    for path in paths:
        if (path / "summary.json").is_file():
            runs.append(path)
            continue
        inside = sorted((p.parent for p in path.glob("*/summary.json")),
                        key=lambda d: (d / "summary.json").stat().st_mtime)
        if not inside:
            raise FileNotFoundError(f"{path} is neither a finished run (no summary.json) nor a "
                                    "sweep directory holding finished runs")
        runs += inside
    return runs


def labelled_runs(parser, run_dirs: list[Path], labels: list[str] | None) -> list[tuple]:
    """``(run directory, name)`` for the runs in ``run_dirs`` (sweeps expanded); the names are
    ``labels`` or the directories' names."""
    run_dirs = expand_runs(run_dirs)
    labels = labels or [d.name for d in run_dirs]
    if len(labels) != len(run_dirs):
        parser.error(f"{len(labels)} labels for {len(run_dirs)} run directories")
    return list(zip(run_dirs, labels, strict=True))


def summary(run_dir: Path) -> dict:
    """The run's ``summary.json``."""
    return json.loads((run_dir / "summary.json").read_text())


def late_median(series) -> float | None:
    """The median of the second half of a logged ``(steps, values)`` series (None: not logged):
    a rate after the warm-up and compilation."""
    if not series:
        return None
    values = series[1]
    return float(statistics.median(values[len(values) // 2:]))


def baseline_row(rows: list, name: str | None):
    """The row named ``name`` (default gpt2), else the first."""
    return next((r for r in rows if r.name == (name or "gpt2")), rows[0])


def cell(value, spec: str) -> str:
    """``value`` formatted by ``spec``; ``-`` for a missing or NaN value."""
    return "-" if value is None or value != value else format(value, spec)
