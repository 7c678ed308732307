"""The run's loggers: wandb (offline unless logged in), CSV, or none."""

from __future__ import annotations

import netrc
import os
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from omegaconf import DictConfig

from minigpt.train.config import ConfigError


def _wandb_logged_in() -> bool:
    """True when an API key is configured, checked without a prompt or a network call."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def build_loggers(logger_cfg: DictConfig, run_dir: Path, config: dict) -> list:
    """The loggers for ``logger.type``: wandb (offline unless logged in; CSV if it cannot
    start), csv, or none. wandb never prompts and never takes a run down with it."""
    kind = logger_cfg.type
    if kind == "none":
        return []
    csv = L.pytorch.loggers.CSVLogger(run_dir, name="csv", version="")
    if kind == "csv":
        return [csv]
    if kind != "wandb":
        raise ConfigError(f"logger.type={kind!r} must be wandb, csv or none")
    mode = os.environ.get("WANDB_MODE") or logger_cfg.get("mode") or (
        "online" if _wandb_logged_in() else "offline")
    try:
        import wandb

        wandb_logger = L.pytorch.loggers.WandbLogger(
            project=logger_cfg.project, entity=logger_cfg.get("entity"),
            name=logger_cfg.get("name"), tags=list(logger_cfg.get("tags") or []),
            save_dir=str(run_dir), mode=mode,
            settings=wandb.Settings(init_timeout=60, console="off"),
        )
        # Lightning always passes wandb.init(anonymous=None), and recent wandb versions warn
        # that the (deprecated) setting has no effect whenever it is passed at all: a warning
        # the user cannot act on. Not passing it changes nothing else.
        getattr(wandb_logger, "_wandb_init", {}).pop("anonymous", None)
        if rank_zero_only.rank == 0:
            run = wandb_logger.experiment  # start now, so a failure shows before training
            run.config.update(config, allow_val_change=True)
            run.summary["run_dir"] = str(run_dir)
            run.summary["checkpoint_dir"] = str(run_dir / "checkpoints")
            rank_zero_info(f"wandb: {mode} run {run.id} in {run_dir / 'wandb'}"
                           + ("; sync later with `wandb sync`" if mode == "offline" else ""))
        return [wandb_logger]
    except Exception as e:  # missing package, bad key, no network, ...
        rank_zero_warn(f"wandb could not start ({type(e).__name__}: {e}); logging to "
                       f"{run_dir / 'csv'} instead")
        return [csv]
