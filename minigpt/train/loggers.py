"""The run's loggers, as Lightning Fabric loggers: CSV (``csv/metrics.csv``) for ``logger=csv``
and ``logger=wandb``, plus wandb (offline unless logged in) for the latter; none for
``logger=none``."""

from __future__ import annotations

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


def build_loggers(logger_cfg: LoggerSchema, run_dir: Path) -> list[Logger]:
    """The loggers for ``logger.type``. Nothing is written until the first thing is logged, so a
    run that fails its checks leaves no log directory behind."""
    kind = logger_cfg.type  # one of the three: minigpt.config.rules checks it
    if kind == "none":
        return []
    # Written through at every logging step, so a user watching metrics.csv sees it grow.
    csv = CSVLogger(root_dir=run_dir, name="csv", version="", flush_logs_every_n_steps=1)
    return [csv] if kind == "csv" else [csv, WandbRun(logger_cfg, run_dir)]


class WandbRun(Logger):
    """A wandb run as a Fabric logger: started by ``start()`` on rank 0 (offline unless logged
    in; never prompts), inert elsewhere or when wandb cannot start (the CSV log still has it all).

    Written here rather than Lightning's ``WandbLogger``: that one always passes wandb a
    deprecated argument that wandb warns about on every run, and raises in the middle of training
    when wandb fails to start; this one calls only wandb's public ``init``/``log``."""

    def __init__(self, logger_cfg: LoggerSchema, run_dir: Path):
        self.cfg, self.run_dir = logger_cfg, Path(run_dir)
        self.run: Any = None

    @property
    def name(self) -> str:
        return "wandb"

    @property
    def version(self) -> str:
        return self.run.id if self.run is not None else ""

    @rank_zero_only
    def start(self, config: dict) -> str | None:
        """Start the run (one line saying where), or warn and stay inert."""
        mode = os.environ.get("WANDB_MODE") or self.cfg.mode or (
            "online" if _wandb_logged_in() else "offline")
        try:
            import wandb

            self.run = wandb.init(
                project=self.cfg.project, entity=self.cfg.entity, name=self.cfg.name,
                tags=list(self.cfg.tags), dir=str(self.run_dir), mode=mode,
                config=config, settings=wandb.Settings(init_timeout=60, console="off"),
            )
            self.run.summary["run_dir"] = str(self.run_dir)
            self.run.summary["checkpoint_dir"] = str(self.run_dir / "checkpoints")
        except Exception as e:  # missing package, bad key, no network, ...
            rank_zero_warn(f"wandb could not start ({type(e).__name__}: {e}); the run logs to "
                           f"{self.run_dir / 'csv'} only")
            self.run = None
            return None
        return f"wandb: {mode} run {self.run.id} in {self.run_dir / 'wandb'}" + (
            "; sync later with `wandb sync`" if mode == "offline" else "")

    @rank_zero_only
    def log_hyperparams(self, params: dict, *args: Any, **kwargs: Any) -> None:
        if self.run is not None:
            self.run.config.update(params, allow_val_change=True)

    @rank_zero_only
    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        if self.run is not None:
            self.run.log({**metrics, "trainer/global_step": step})  # minigpt.viz reads it

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
