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
import math
import netrc
import os
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException
from omegaconf import DictConfig, OmegaConf

from minigpt.callbacks import (
    AtomicCheckpointIO,
    CheckpointOnInterrupt,
    SampleText,
    gathered_parameters,
)
from minigpt.checkpoint import find_latest_checkpoint, load_checkpoint
from minigpt.data import (
    DataConfig,
    TokenDataModule,
    check_vocab_fits,
    open_tokens,
    prepare_dataset,
)
from minigpt.lit import LitGPT, default_precision
from minigpt.model import GPT, GPTConfig
from minigpt.tokenizer import tokenizer_from_dict

log = logging.getLogger(__name__)
VOCAB_MULTIPLE = 64  # pad the embedding/LM head to a multiple of 64 for faster matmuls
MODEL_EXTRA_KEYS = ("name", "init_from")  # model/*.yaml keys that are not GPTConfig fields


class ConfigError(ValueError):
    """A bad config value, found before any work starts; the message names each one."""


def padded_vocab_size(tokenizer_vocab: int, pinned: int | None) -> int:
    """The model's vocabulary: ``pinned`` if set (it must fit the tokenizer), else the
    tokenizer's rounded up to a multiple of 64."""
    if pinned is None:
        return math.ceil(tokenizer_vocab / VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if pinned < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size={pinned} is smaller than the tokenizer's vocabulary "
                          f"({tokenizer_vocab}); remove it to size the model from the data")
    return pinned


def check_config(cfg: DictConfig) -> None:
    """Every user-facing value that can be wrong, checked at once before training."""
    problems = []
    o, t = cfg.optim, cfg.trainer
    for key in ("lr", "min_lr", "weight_decay", "eps", "grad_clip"):
        value = o.get(key)
        if value is not None and (not isinstance(value, (int, float)) or value < 0):
            problems.append(f"optim.{key}={value!r} must be a number >= 0")
    if cfg.get("cpu_speedups", "auto") not in ("auto", False):
        problems.append(f"cpu_speedups={cfg.get('cpu_speedups')!r} must be auto or false")
    threads = cfg.get("threads")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        problems.append(f"threads={threads!r} must be null or a positive integer")
    if isinstance(o.get("lr"), (int, float)) and o.lr == 0:
        problems.append("optim.lr=0 would not train; use a positive learning rate")
    if isinstance(o.get("min_lr"), (int, float)) and isinstance(o.get("lr"), (int, float)) \
            and o.lr > 0 and o.min_lr > o.lr:
        problems.append(f"optim.min_lr={o.min_lr} must not exceed optim.lr={o.lr}")
    for key in ("beta1", "beta2"):
        if not 0 <= o.get(key, 0.9) < 1:
            problems.append(f"optim.{key}={o.get(key)} must be in [0, 1)")
    for key in ("warmup_steps", "decay_steps"):
        if not isinstance(o.get(key), int) or o.get(key) < 0:
            problems.append(f"optim.{key}={o.get(key)!r} must be an integer >= 0")
    if not isinstance(t.get("max_steps"), int) or t.max_steps < 1:
        problems.append(f"trainer.max_steps={t.get('max_steps')!r} must be a positive integer")
    accumulate = t.get("accumulate_grad_batches", 1)
    if not isinstance(accumulate, int) or accumulate < 1:
        problems.append(f"trainer.accumulate_grad_batches={accumulate!r} must be a positive integer")
    for key in ("batch_size", "num_workers", "val_tokens"):
        value, low = cfg.data.get(key), 0 if key == "num_workers" else 1
        if value is not None and (not isinstance(value, int) or value < low):
            problems.append(f"data.{key}={value!r} must be an integer >= {low}")
    problems += _device_problems(t)
    model = OmegaConf.to_container(cfg.model, resolve=True)
    try:
        gpt_config(model, model.get("vocab_size") or VOCAB_MULTIPLE)
    except ValueError as e:
        problems.append(f"model: {e}")
    if problems:
        raise ConfigError("bad config: " + "; ".join(problems))


def _device_problems(t: DictConfig) -> list[str]:
    accelerator, devices = t.get("accelerator", "auto"), t.get("devices", "auto")
    if devices in ("auto", -1, "-1", None) or isinstance(devices, str):
        return []
    count = len(devices) if OmegaConf.is_list(devices) else devices
    if not isinstance(count, int) or count < 1:
        return [f"trainer.devices={devices!r} must be a positive integer, a list of ids, or auto"]
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        have, what = torch.cuda.device_count(), "GPU(s)"
    else:
        have, what = os.cpu_count() or 1, "CPU core(s) (one process each)"
    if count > have:
        return [f"trainer.devices={devices} but this machine has {have} {what}"]
    return []


def gpt_config(model_cfg: dict, vocab_size: int) -> GPTConfig:
    fields = {k: v for k, v in model_cfg.items() if k not in MODEL_EXTRA_KEYS}
    fields["vocab_size"] = vocab_size
    return GPTConfig.from_dict(fields)


def init_model(model_cfg: dict, tokenizer, vocab_size: int) -> GPT:
    """A fresh ``GPT``, or weights from ``model.init_from``: a Hugging Face GPT-2 directory
    (``GPT.from_pretrained``) or one of our ``.ckpt`` files. A pretrained source fixes the
    architecture; ``model.dropout`` (and, for GPT-2, a shorter ``model.context_length``) apply."""
    source = model_cfg.get("init_from")
    if not source:
        return GPT(gpt_config(model_cfg, vocab_size))
    path = Path(source).expanduser()
    if path.is_dir():
        model = GPT.from_pretrained(str(path), dropout=model_cfg.get("dropout", 0.0),
                                    context_length=model_cfg["context_length"])
        if tokenizer.name not in ("gpt2", "r50k_base"):
            rank_zero_warn(f"model.init_from={source} is GPT-2, but the data uses the "
                           f"{tokenizer.name!r} tokenizer: the pretrained embeddings will not fit")
    else:
        loaded, ckpt_tokenizer, _ = load_checkpoint(path)
        if ckpt_tokenizer.to_dict() != tokenizer.to_dict():
            raise ConfigError(f"model.init_from={source} was trained with tokenizer "
                              f"{ckpt_tokenizer.name!r}, the data uses {tokenizer.name!r}: "
                              "prepare the data with the checkpoint's tokenizer")
        config = GPTConfig.from_dict({**loaded.config.to_dict(),
                                      "dropout": model_cfg.get("dropout", 0.0)})
        model = GPT(config)
        model.load_state_dict(loaded.state_dict())
    if model.config.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.init_from={source} has vocab_size={model.config.vocab_size}, "
                          f"smaller than the tokenizer's {tokenizer.vocab_size}")
    rank_zero_info(f"initialized from {source}: {model.config}")
    model.train()
    return model


def apply_cpu_speedups(model: GPT, cfg: DictConfig) -> list[str]:
    """``minigpt.cpu.speed_up_training`` for a CPU run unless ``cpu_speedups=false``; logs what
    it applied. Called once, after the model is built and before compiling or FSDP wrapping."""
    accelerator = cfg.trainer.get("accelerator", "auto")
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if cfg.get("cpu_speedups", "auto") is False or not on_cpu:
        return []
    from minigpt.cpu import speed_up_training

    precision = cfg.trainer.get("precision") or default_precision(accelerator)
    applied = speed_up_training(model, precision=str(precision), compiled=bool(cfg.compile))
    rank_zero_info(f"cpu speedups: {', '.join(applied) or 'none apply'}")
    return applied


def resolve_ckpt_path(ckpt_path: str | None, root: Path) -> str | None:
    """``None``; ``last``: the newest ``last.ckpt`` under ``root`` (``outputs/``); or a path."""
    if not ckpt_path:
        return None
    if ckpt_path == "last":
        return str(find_latest_checkpoint(root))
    path = Path(ckpt_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"ckpt_path={ckpt_path}: no such checkpoint file")
    return str(path)


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


class StepProgressBar(TQDMProgressBar):
    """Lightning's bar, labelled by step: "epochs" of an endless stream mean nothing."""

    def on_train_epoch_start(self, trainer, *args):
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description("train")


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


def build_trainer(cfg: DictConfig, run_dir: Path, callbacks: list, loggers: list) -> L.Trainer:
    t = OmegaConf.to_container(cfg.trainer, resolve=True)
    fsdp = t.pop("fsdp", None) or {}
    if t.get("precision") is None:
        t["precision"] = default_precision(t.get("accelerator", "auto"))
    if t.get("strategy") == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        from minigpt.model import Block

        # One FSDP unit per transformer block; activation checkpointing per block if asked.
        t["strategy"] = FSDPStrategy(
            auto_wrap_policy={Block},
            activation_checkpointing_policy={Block} if fsdp.get("activation_checkpointing") else None,
            sharding_strategy=fsdp.get("sharding_strategy", "FULL_SHARD"),
            state_dict_type="full",  # one .ckpt file that generate.py reads
            use_orig_params=True,
        )
    try:
        return L.Trainer(
            **t,
            default_root_dir=str(run_dir),
            callbacks=callbacks,
            logger=loggers or False,
            plugins=[AtomicCheckpointIO()],
            max_epochs=-1,  # the training stream is endless; max_steps ends the run
            check_val_every_n_epoch=None,  # val_check_interval counts batches across "epochs"
        )
    except (ValueError, TypeError, MisconfigurationException) as e:
        # Lightning's own checks (no GPU for accelerator=gpu, FSDP on a CPU, unknown argument):
        # clear messages, reported as a config error rather than a traceback.
        raise ConfigError(f"trainer: {e}") from None


def run(cfg: DictConfig, run_dir: str | Path | None = None, callbacks: list | tuple = ()) -> dict:
    """Train as ``cfg`` says; return ``{"run_dir", "last", "best", "val_loss", "steps"}``.

    ``run_dir`` defaults to Hydra's run directory; ``callbacks`` are added to the trainer's."""
    check_config(cfg)
    warnings.filterwarnings("ignore", message=".*IterableDataset. has .__len__. defined")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    # LitGPT reduces the validation sums over ranks itself: every rank logs the same val/loss.
    warnings.filterwarnings("ignore", message=r".*sync_dist=True.. when logging on epoch level")
    run_dir = _run_dir(run_dir).resolve()
    ckpt_path = resolve_ckpt_path(cfg.get("ckpt_path"), Path("outputs"))
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    torch.set_float32_matmul_precision("high")  # TF32 matmuls on GPUs that have them
    if cfg.get("threads"):
        torch.set_num_threads(cfg.threads)

    # Data first: the model's vocabulary comes from the prepared data's tokenizer. Every rank
    # may call this; preparation is locked and idempotent (one prepares, the rest reuse).
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
    context_length = model.config.context_length
    apply_cpu_speedups(model, cfg)
    # Same initial weights on every rank (above); from here each rank draws its own dropout masks.
    L.seed_everything(cfg.seed + rank_zero_only.rank, workers=True, verbose=False)
    datamodule = TokenDataModule(data_cfg, context_length, seed=cfg.seed, data_root=str(data_root))

    lit = LitGPT(
        model, OmegaConf.to_container(cfg.optim, resolve=True), tokenizer.to_dict(),
        compile=cfg.compile,
        bytes_per_token=bytes_per_token(datamodule.directory, meta, tokenizer, data_cfg.val_tokens),
        peak_flops=cfg.get("peak_flops"),
    )
    ckpt_dir = run_dir / "checkpoints"
    checkpoints = ModelCheckpoint(
        dirpath=ckpt_dir, filename="best", monitor="val/loss", mode="min", save_top_k=1,
        save_last=True, auto_insert_metric_name=False, enable_version_counter=False,
    )
    interrupt = CheckpointOnInterrupt(ckpt_dir / "last.ckpt")
    s = cfg.sample
    bar = [StepProgressBar()] if cfg.trainer.get("enable_progress_bar", True) else []
    callbacks = [checkpoints, interrupt, *bar,
                 SampleText(tokenizer, run_dir / "samples.txt", prompt=s.prompt,
                            max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                            top_k=s.top_k, seed=cfg.seed), *callbacks]
    trainer = build_trainer(cfg, run_dir, callbacks, loggers=[])  # its checks first, then wandb
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved["model"]["vocab_size"] = model.config.vocab_size
    trainer.loggers = build_loggers(cfg.logger, run_dir, resolved)

    if trainer.is_global_zero:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
        n = model.num_params()
        rank_zero_info(
            f"run dir: {run_dir}\nmodel: {n / 1e6:.2f}M parameters, {model.config}\n"
            f"data: {data_cfg.name}, tokenizer {tokenizer.name} (vocab {tokenizer.vocab_size}, "
            f"model vocab {vocab}), {meta['train_tokens']:,} train tokens\n"
            f"precision: {trainer.precision}, devices: {trainer.num_devices} x "
            f"{trainer.num_nodes} node(s), strategy: {type(trainer.strategy).__name__}"
            + (f"\nresuming from {ckpt_path}" if ckpt_path else "")
        )
    try:
        trainer.fit(lit, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
    except SIGTERMException:
        # Checkpoint already written by CheckpointOnInterrupt; exit like a killed process.
        raise SystemExit(130 if interrupt.signal_name == "Ctrl-C" else 143) from None

    # Every rank logs this to its own file in the run dir: under DDP (and FSDP, gathered) the
    # ranks must agree.
    with gathered_parameters(getattr(trainer.strategy, "model", None), recurse=True):
        checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    log.info(f"rank {trainer.global_rank}: parameter checksum {checksum:.10e}")
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
