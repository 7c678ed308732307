"""The body of ``train.py``: a composed Hydra config in, a trained run directory out.

``run(cfg)`` checks the whole config first (one message listing every bad value), prepares the
data, sizes the model from the tokenizer, builds the LightningModule, trainer, callbacks and
logger explicitly, and fits. ``train.py`` is only the ``@hydra.main`` wrapper around it, so tests
call ``run`` in-process on a config from Hydra's compose API.

Run directory layout: ``config.yaml`` (resolved), ``checkpoints/{last,best}.ckpt``,
``samples.txt``, ``csv/`` or ``wandb/`` logs, ``summary.json``.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from minigpt.checkpoint import find_latest_checkpoint
from minigpt.consolidate import is_sharded_checkpoint
from minigpt.data import (
    DataConfig,
    TokenDataModule,
    check_vocab_fits,
    open_tokens,
    prepare_dataset,
)
from minigpt.model import GPT
from minigpt.tokenizer import Tokenizer, tokenizer_from_dict
from minigpt.train.batch import BatchPlan
from minigpt.train.callbacks import (
    CheckpointOnInterrupt,
    LinkingModelCheckpoint,
    ModelFileAtEnd,
    SampleText,
    StepProgressBar,
    gathered_parameters,
)
from minigpt.train.config import ConfigError, check_config, gpt_config
from minigpt.train.device import compile_enabled, default_precision, resolve_accelerator
from minigpt.train.lit import LitGPT
from minigpt.train.loggers import build_loggers
from minigpt.train.model_init import init_model, padded_vocab_size
from minigpt.train.preflight import (
    check_run_fits,
    out_of_memory_as_resource_error,
    vocab_before_data,
)
from minigpt.train.resume import ResumePoint, check_resume_matches, read_resume_point
from minigpt.train.trainer import build_trainer, sharded_checkpoints

log = logging.getLogger(__name__)


def run(cfg: DictConfig, run_dir: str | Path | None = None, callbacks: list | tuple = ()) -> dict:
    """Train as ``cfg`` says; return ``{"run_dir", "last", "best", "val_loss", "steps"}``.

    ``run_dir`` defaults to Hydra's run directory; ``callbacks`` are added to the trainer's."""
    check_config(cfg)
    quiet_warnings()
    run_dir = _run_dir(run_dir).resolve()
    ckpt_path = resolve_ckpt_path(cfg.get("ckpt_path"), Path("outputs"))
    resume = read_resume_point(ckpt_path, cfg.trainer.max_steps) if ckpt_path else None
    preflight(cfg, resume)  # before the data is prepared: bad sizes fail in seconds
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    torch.set_float32_matmul_precision("high")  # TF32 matmuls on GPUs that have them
    if cfg.get("threads"):
        torch.set_num_threads(cfg.threads)

    setup = prepare(cfg)
    model_config = setup.model.config.to_dict()
    if resume is not None:
        check_resume_matches(resume, model_config, setup.tokenizer.to_dict())
    check_run_fits(cfg, model_config)  # again with the exact vocabulary and architecture
    compiled = compile_enabled(cfg.compile, cfg.trainer.get("accelerator"))
    apply_cpu_speedups(setup.model, cfg, compiled)
    # Same initial weights on every rank (above); from here each rank draws its own dropout masks.
    L.seed_everything(cfg.seed + rank_zero_only.rank, workers=True, verbose=False)
    lit = LitGPT(
        setup.model, OmegaConf.to_container(cfg.optim, resolve=True), setup.tokenizer.to_dict(),
        compile=compiled, peak_flops=cfg.get("peak_flops"),
        bytes_per_token=bytes_per_token(setup.datamodule.directory, setup.meta, setup.tokenizer,
                                        setup.data_cfg.val_tokens),
    )
    ckpt_dir = run_dir / "checkpoints"
    checkpoints = LinkingModelCheckpoint(
        dirpath=ckpt_dir, filename="best", monitor="val/loss", mode="min", save_top_k=1,
        save_last=True, auto_insert_metric_name=False, enable_version_counter=False,
        save_on_train_epoch_end=False,  # after validations: the endless stream has no epochs
    )
    interrupt = CheckpointOnInterrupt(ckpt_dir / "last.ckpt")
    callbacks = [checkpoints, interrupt, *_standard_callbacks(cfg, setup.tokenizer, run_dir),
                 *callbacks]
    if sharded_checkpoints(cfg):
        callbacks.append(ModelFileAtEnd(ckpt_dir))
    trainer = build_trainer(cfg, run_dir, callbacks, loggers=[],  # its checks first, then wandb
                            context_length=setup.model.config.context_length)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved["model"]["vocab_size"] = setup.model.config.vocab_size
    trainer.loggers = build_loggers(cfg.logger, run_dir, resolved)
    if trainer.is_global_zero:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
        rank_zero_info(_describe(run_dir, setup, trainer, ckpt_path))
    try:
        with out_of_memory_as_resource_error(cfg):
            trainer.fit(lit, datamodule=setup.datamodule, ckpt_path=ckpt_path, weights_only=True)
    except SIGTERMException:
        # Checkpoint already written by CheckpointOnInterrupt; exit like a killed process.
        raise SystemExit(130 if interrupt.signal_name == "Ctrl-C" else 143) from None
    return _finish(trainer, setup.model, run_dir, checkpoints)


@dataclass
class Setup:
    """What a run trains: the data (prepared), its tokenizer, and the model sized from it."""

    data_cfg: DataConfig
    meta: dict
    tokenizer: Tokenizer
    model: GPT
    datamodule: TokenDataModule


def prepare(cfg: DictConfig) -> Setup:
    """Data first: the model's vocabulary comes from the prepared data's tokenizer. Every rank
    may call this; preparation is locked and idempotent (one prepares, the rest reuse)."""
    data_cfg = DataConfig.from_any(cfg.data)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    data_root = Path(cfg.data_root).expanduser().resolve()
    meta = prepare_dataset(data_cfg, data_root, progress=rank_zero_only.rank == 0)
    tokenizer = tokenizer_from_dict(meta["tokenizer"])
    vocab = padded_vocab_size(tokenizer.vocab_size, model_cfg.get("vocab_size"))
    model = init_model(model_cfg, tokenizer, vocab)
    try:  # the data's own record of its largest token id, against the model's embeddings
        check_vocab_fits(meta, model.config.vocab_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    datamodule = TokenDataModule(data_cfg, model.config.context_length, seed=cfg.seed,
                                 data_root=str(data_root))
    return Setup(data_cfg, meta, tokenizer, model, datamodule)


def preflight(cfg: DictConfig, resume: ResumePoint | None) -> None:
    """What can be checked from the config alone, before any heavy work: a resumed checkpoint's
    model against the configured one, and whether a training step fits in memory. A model from
    ``model.init_from`` is only known once built (``run`` checks it then)."""
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    if model_cfg.get("init_from"):
        return
    vocab = model_cfg.get("vocab_size") or padded_vocab_size(
        resume.model_config["vocab_size"] if resume else vocab_before_data(cfg.data.tokenizer),
        None)
    model_config = gpt_config(model_cfg, vocab).to_dict()
    if resume is not None:
        check_resume_matches(resume, model_config, skip=("vocab_size",))
    check_run_fits(cfg, model_config)


def apply_cpu_speedups(model: GPT, cfg: DictConfig, compiled: bool = False) -> list[str]:
    """``minigpt.cpu.speed_up_training`` for a CPU run unless ``cpu_speedups=false``; logs what
    it applied. Called once, after the model is built and before compiling or FSDP wrapping."""
    accelerator = resolve_accelerator(cfg.trainer.get("accelerator", "auto"))
    if cfg.get("cpu_speedups", "auto") is False or accelerator != "cpu":
        return []
    from minigpt.cpu import speed_up_training

    precision = cfg.trainer.get("precision") or default_precision(accelerator)
    applied = speed_up_training(model, precision=str(precision), compiled=compiled)
    rank_zero_info(f"cpu speedups: {', '.join(applied) or 'none apply'}")
    return applied


def quiet_warnings() -> None:
    """Silence warnings a user can do nothing about; each filter says why it is safe."""
    # Our token stream is endless; Lightning warns about its (nominal) length.
    warnings.filterwarnings("ignore", message=".*IterableDataset. has .__len__. defined")
    # A deprecation inside torch's pytree, raised from Lightning's code, not ours.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    # LitGPT reduces the validation sums over ranks itself: every rank logs the same val/loss.
    warnings.filterwarnings("ignore", message=r".*sync_dist=True.. when logging on epoch level")
    # The model summary's size estimate assumes float32 weights; under bf16-mixed they are.
    warnings.filterwarnings("ignore", message=r".*is not supported by the model summary")
    # Lightning advertises its cloud logger on every run; an advertisement is not a diagnostic.
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_drop_lightning_tips)


def _drop_lightning_tips(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("💡 Tip:")


def _standard_callbacks(cfg: DictConfig, tokenizer: Tokenizer, run_dir: Path) -> list:
    s = cfg.sample
    bar = [StepProgressBar()] if cfg.trainer.get("enable_progress_bar", True) else []
    sample = SampleText(tokenizer, run_dir / "samples.txt", prompt=s.prompt,
                        max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                        top_k=s.top_k, seed=cfg.seed)
    return [*bar, sample]


def _describe(run_dir: Path, setup: Setup, trainer: L.Trainer, ckpt_path: str | None) -> str:
    model, tokenizer = setup.model, setup.tokenizer
    batch = BatchPlan(setup.data_cfg.batch_size, model.config.context_length,
                      trainer.accumulate_grad_batches, trainer.world_size)
    return (
        f"run dir: {run_dir}\nmodel: {model.num_params() / 1e6:.2f}M parameters, "
        f"{model.config}\ndata: {setup.data_cfg.name}, tokenizer {tokenizer.name} (vocab "
        f"{tokenizer.vocab_size}, model vocab {model.config.vocab_size}), "
        f"{setup.meta['train_tokens']:,} train tokens\nbatch: {batch.describe()}\nprecision: "
        f"{trainer.precision}, devices: "
        f"{trainer.num_devices} x {trainer.num_nodes} node(s), strategy: "
        f"{type(trainer.strategy).__name__}" + (f"\nresuming from {ckpt_path}" if ckpt_path else "")
    )


def _finish(trainer: L.Trainer, model: GPT, run_dir: Path,
            checkpoints: LinkingModelCheckpoint) -> dict:
    """The run's summary (also ``summary.json``), after a parameter checksum every rank logs to
    its own file: under DDP (and FSDP, gathered) the ranks must agree."""
    with gathered_parameters(getattr(trainer.strategy, "model", None), recurse=True):
        checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    log.info(f"rank {trainer.global_rank}: parameter checksum {checksum:.10e}")
    ckpt_dir = run_dir / "checkpoints"
    val_loss = trainer.callback_metrics.get("val/loss")
    summary = {
        "run_dir": str(run_dir),
        "last": str(ckpt_dir / "last.ckpt") if (ckpt_dir / "last.ckpt").exists() else None,
        "best": checkpoints.best_model_path or None,
        "val_loss": float(val_loss) if val_loss is not None else None,
        "steps": trainer.global_step,
    }
    if trainer.is_global_zero:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        rank_zero_info(f"done: {summary['steps']} steps, val/loss {summary['val_loss']}, "
                       f"checkpoints in {ckpt_dir}; sample with `python generate.py`")
    return summary


def resolve_ckpt_path(ckpt_path: str | None, root: Path) -> str | None:
    """``None``; ``last``: the newest ``last.ckpt`` under ``root`` (``outputs/``); or a path."""
    if not ckpt_path:
        return None
    if ckpt_path == "last":
        return str(find_latest_checkpoint(root))
    path = Path(ckpt_path).expanduser()
    if not path.is_file() and not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"ckpt_path={ckpt_path}: no such checkpoint file")
    return str(path)


def run_id() -> str:
    """The last part of the run directory: the time (HH-MM-SS), or for a multi-process launch by
    torchrun or srun an id that every rank and node shares (their clocks may straddle a second)."""
    from datetime import datetime

    env = os.environ
    if env.get("TORCHELASTIC_RUN_ID", "none") != "none":
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}"
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in env:
        return f"slurm-{env['SLURM_JOB_ID']}-{env.get('SLURM_STEP_ID', '0')}"
    return datetime.now().strftime("%H-%M-%S")


def _run_dir(run_dir) -> Path:
    if run_dir is not None:
        return Path(run_dir)
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def bytes_per_token(directory: Path, meta: dict, tokenizer, budget: int) -> float | None:
    """UTF-8 bytes per token over the first ``budget`` validation tokens (for bits per byte)."""
    try:
        tokens = open_tokens(directory, "val", meta)[:budget]
        n_bytes = len(tokenizer.decode(tokens.tolist()).encode("utf-8"))
        return n_bytes / max(1, len(tokens))
    except Exception as e:
        rank_zero_warn(f"val/bpb is off: cannot measure bytes per token ({e})")
        return None
