"""The run's Fabric loggers: CSV (``csv/metrics.csv``) for ``logger=csv`` and ``logger=wandb``,
plus wandb (offline unless logged in) for the latter. A run resumed in its own directory
continues both."""

from __future__ import annotations

import csv
import netrc
import os
from pathlib import Path
from typing import Any

from lightning.fabric.loggers import CSVLogger, Logger
from lightning.fabric.utilities import rank_zero_only, rank_zero_warn

from minigpt.config.schema import LoggerSchema


def _wandb_logged_in() -> bool:
    """True when an API key is configured, checked without a prompt or a network call."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def build_loggers(logger_cfg: LoggerSchema, run_dir: Path,
                  resume_step: int | None = None) -> list[Logger]:
    """The loggers for ``logger.type``; ``resume_step``: the resumed checkpoint's step. Nothing is
    written before ``start`` or the first thing logged."""
    kind = logger_cfg.type  # one of the three: minigpt.config.rules checks it
    if kind == "none":
        return []
    table = ContinuedCSV(run_dir, resume_step)
    return [table] if kind == "csv" else [table, WandbRun(logger_cfg, run_dir, resume_step)]


class ContinuedCSV(CSVLogger):
    """Fabric's CSV logger on ``<run_dir>/csv/metrics.csv``, written through at every logging
    step. Resumed in the same run directory, ``start`` keeps the earlier rows up to the
    checkpoint's step (Fabric's logger alone would delete the file), so it reads as one run."""

    def __init__(self, run_dir: Path, resume_step: int | None = None):
        super().__init__(root_dir=run_dir, name="csv", version="", flush_logs_every_n_steps=1)
        self.resume_step = resume_step
        # The earlier log while its rows are being written back: if this process dies before
        # that is done, the next resume reads it from here again.
        self.moved = Path(run_dir) / ".metrics.csv.resuming"

    @rank_zero_only
    def start(self, config: dict) -> str | None:
        """Write back the earlier rows (before anything else is logged); a line saying what
        was dropped, if anything."""
        metrics = Path(self.log_dir) / "metrics.csv"
        if self.resume_step is None or not (self.moved.is_file() or metrics.is_file()):
            return None
        if not self.moved.is_file():
            os.replace(metrics, self.moved)  # Fabric's writer deletes a metrics.csv it finds
        else:  # an earlier resume died writing the rows back: that metrics.csv is a part of them
            metrics.unlink(missing_ok=True)
        with open(self.moved, newline="") as f:
            rows = list(csv.DictReader(f))
        kept = [row for row in rows if _step(row) <= self.resume_step]
        for row in kept:
            self.log_metrics({k: v for k, v in row.items() if k != "step" and v != ""},
                             _step(row))
        self.moved.unlink()
        dropped = len(rows) - len(kept)
        return (f"{metrics}: dropped {dropped} row(s) past step {self.resume_step} that the "
                "interrupted run wrote") if dropped else None


def _step(row: dict) -> int:
    return int(row.get("step") or 0)


class WandbRun(Logger):
    """A wandb run as a Fabric logger, started by ``start()`` on rank 0 (offline unless logged
    in; never prompts); inert elsewhere or when wandb cannot start (unlike Lightning's
    ``WandbLogger``, which raises mid-training)."""

    def __init__(self, logger_cfg: LoggerSchema, run_dir: Path, resume_step: int | None = None):
        self.cfg, self.run_dir, self.resume_step = logger_cfg, Path(run_dir), resume_step
        self.run: Any = None
        self.id_file = self.run_dir / "wandb" / "run_id"  # resuming here continues that run

    @property
    def name(self) -> str:
        return "wandb"

    @property
    def version(self) -> str:
        return self.run.id if self.run is not None else ""

    @rank_zero_only
    def start(self, config: dict) -> str | None:
        """Start the run, or when resuming in its directory continue the run it logged to
        (one line saying where); or warn and stay inert."""
        mode = os.environ.get("WANDB_MODE") or self.cfg.mode or (
            "online" if _wandb_logged_in() else "offline")
        earlier = self.id_file.read_text().strip() \
            if self.resume_step is not None and self.id_file.is_file() else None
        try:
            import wandb

            self.run = wandb.init(
                project=self.cfg.project, entity=self.cfg.entity, name=self.cfg.name,
                tags=list(self.cfg.tags), dir=str(self.run_dir), mode=mode,
                config=config, settings=wandb.Settings(init_timeout=60, console="off"),
                id=earlier, resume="allow" if earlier else None,
            )
            self.id_file.parent.mkdir(parents=True, exist_ok=True)
            self.id_file.write_text(f"{self.run.id}\n")
            self.run.summary["run_dir"] = str(self.run_dir)
            self.run.summary["checkpoint_dir"] = str(self.run_dir / "checkpoints")
        except Exception as e:  # missing package, bad key, no network, ...
            rank_zero_warn(f"wandb could not start ({type(e).__name__}: {e}); the run logs to "
                           f"{self.run_dir / 'csv'} only")
            self.run = None
            return None
        return f"wandb: {mode} run {self.run.id}{' continued' if earlier else ''} in " \
            f"{self.run_dir / 'wandb'}" + (
            "; sync later with `wandb sync`" if mode == "offline" else "")

    @rank_zero_only
    def log_hyperparams(self, params: dict, *args: Any, **kwargs: Any) -> None:
        if self.run is not None:
            self.run.config.update(params, allow_val_change=True)

    @rank_zero_only
    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        if self.run is not None:
            self.run.log({**metrics, "trainer/global_step": step})  # Lightning's step key

    @rank_zero_only
    def log_samples(self, rows: list[list]) -> None:
        """The samples so far as one table (wandb shows a table's latest version)."""
        if self.run is not None:
            import wandb

            self.run.log({"samples": wandb.Table(columns=["step", "text"], data=rows)})

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if status == "success" else 1)
            self.run = None
