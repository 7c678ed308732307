"""The body of ``train.py``: ``run(cfg)`` checks the config, resolves the plan, launches Fabric,
prepares the data and the model, and runs the loop. A run directory holds ``config.yaml``,
``checkpoints/{last,best}.ckpt``, ``samples.txt``, ``csv/``, ``wandb/`` and ``summary.json``.
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch
from hydra.core.hydra_config import HydraConfig
from lightning.fabric import Fabric
from lightning.fabric.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from omegaconf import DictConfig, OmegaConf

from minigpt.checkpoint import MODEL_FILE, find_latest_checkpoint, is_sharded_checkpoint
from minigpt.checkpoint.consolidate import consolidate
from minigpt.checkpoint.format import LAST
from minigpt.checkpoint.restore import (
    ResumePoint,
    check_resume_matches,
    read_resume_point,
    restore,
)
from minigpt.checkpoint.write import CheckpointFiles
from minigpt.config import TrainSchema, typed
from minigpt.cpu import speed_up_training
from minigpt.data.datamodule import open_training_data
from minigpt.errors import ConfigError
from minigpt.eval.training import training_items, training_tasks
from minigpt.files import atomic_write
from minigpt.model import GPT
from minigpt.paths import check_paths
from minigpt.train.activation_checkpointing import apply_activation_checkpointing
from minigpt.train.config import check_config
from minigpt.train.device import build_fabric
from minigpt.train.loggers import build_loggers
from minigpt.train.loop import Loop, ModelWithLoss, Progress, Sampler, gathered_parameters
from minigpt.train.memory import VOCAB_BEFORE_DATA, check_run_fits, out_of_memory_as_resource_error
from minigpt.train.model_init import init_model, padded_vocab_size
from minigpt.train.optim import build_optimizers, check_optimizers_run, schedule_for
from minigpt.train.plan import RunPlan, batch_record, choose_batch, keep_global_batch, resolve_plan
from minigpt.train.run_dir import hold_run_dir, remove_unstarted

log = logging.getLogger(__name__)


def run(cfg: TrainSchema | DictConfig, run_dir: str | Path | None = None,
        callbacks: list | tuple = ()) -> dict:
    """Train as ``cfg`` (a ``TrainSchema`` or a composed config) says; return the summary.
    ``run_dir``: Hydra's unless given; ``callbacks``: Fabric callbacks (``minigpt.train.loop``
    names the hooks). A failure before the first step leaves nothing behind in ``run_dir``."""
    train = typed(cfg, TrainSchema)
    run_dir = Path(run_dir or HydraConfig.get().runtime.output_dir).resolve()
    writer = hold_run_dir(run_dir, train.ckpt_path)  # one process writes into a run directory
    started = []  # a callback notes the first training step
    first_step = SimpleNamespace(on_train_batch_start=lambda loop, micro: started.append(True))
    try:
        return _run(train, run_dir, [*callbacks, first_step])
    except BaseException:
        if not started and rank_zero_only.rank == 0:
            remove_unstarted(run_dir)
        raise
    finally:
        writer.release()


def _run(train: TrainSchema, run_dir: Path, callbacks: list) -> dict:
    check_config(train)
    check_paths(train)  # every path it names, before anything is built or read
    quiet_warnings()
    ckpt_path = resolve_ckpt_path(train.ckpt_path, Path("outputs"))
    resume = read_resume_point(ckpt_path, train.trainer.max_steps) if ckpt_path else None
    plan = resolve_plan(train)
    check_optimizers_run(train.optim, plan.strategy, plan.precision)  # before Fabric's words
    loggers = build_loggers(train.logger, run_dir, resume.step if resume else None)
    fabric = build_fabric(train.trainer, plan, loggers, callbacks)
    plan, kept = keep_global_batch(plan.with_world(fabric.world_size),
                                   resume.batch if resume else None)
    preflight(train, plan, resume)  # before the data is prepared: bad sizes fail in seconds
    owns_process_group = (torch.distributed.is_available()
                          and not torch.distributed.is_initialized())
    fabric.launch()
    Fabric.seed_everything(train.seed, workers=True, verbose=False)
    torch.set_float32_matmul_precision("high")  # TF32 matmuls on GPUs that have them
    if train.threads:
        torch.set_num_threads(train.threads)

    corpus, model = prepare(train, plan, fabric)
    model_config = model.config.to_dict()
    if resume is not None:
        check_resume_matches(resume, model_config, corpus.tokenizer.to_dict())
    check_run_fits(plan, model_config)  # again with the exact vocabulary and architecture
    apply_activation_checkpointing(model, plan.activation_checkpointing)  # then compile
    apply_cpu_speedups(model, plan)
    # Same initial weights on every rank (above); from here each rank draws its own dropout masks.
    Fabric.seed_everything(train.seed + fabric.global_rank, workers=True, verbose=False)
    module, optimizers, schedulers = build_trainables(train, fabric, plan, model)
    plan, choice = choose_batch(plan, fabric, module, optimizers, model_config)  # the final plan
    train = replace(train, data=replace(train.data, batch_size=plan.batch.batch_size))
    loop = build_loop(train, fabric, plan, corpus, (module, optimizers, schedulers), run_dir)
    if resume is not None:
        restored = restore(fabric, resume, module, optimizers, schedulers, loop.data)
        loop.progress = Progress.restored(restored, plan.val_every)
        loop.pending_rng = restored["rng"]
    loop.progress.batch = batch_record(plan, choice)
    for line in (kept, choice and choice.describe()):
        if line:
            fabric.print(line)
    start_run_dir(loop, run_dir, ckpt_path)
    status = "failed"  # what the loggers are told: a crash, or an interrupt's exit
    try:
        with out_of_memory_as_resource_error(loop):
            loop.fit()
        if plan.sharded_checkpoints:  # the model-only model.ckpt, for generate.py
            if fabric.is_global_zero:
                ckpt_dir = run_dir / "checkpoints"
                path = consolidate(ckpt_dir / LAST, ckpt_dir / MODEL_FILE)
                fabric.print(f"consolidated the model into {path}")
            fabric.barrier()
        status = "success"
    finally:
        for logger in fabric.loggers:
            logger.finalize(status)
    summary = finish(fabric, loop, run_dir)
    # The process group this run started, destroyed after success only (after a failure another
    # rank may be inside a collective): Lightning destroys NCCL's alone, and a gloo group left
    # to interpreter shutdown can abort a run that succeeded (SIGABRT).
    if owns_process_group and torch.distributed.is_initialized():  # none for one process
        fabric.barrier()
        torch.distributed.destroy_process_group()
    return summary


def prepare(train: TrainSchema, plan: RunPlan, fabric: Fabric) -> tuple[object, GPT]:
    """The prepared data (``open_training_data``; every rank calls this, one prepares) and the
    model, whose vocabulary comes from the data's tokenizer and a chat template's tokens."""
    # data.batch_size as the plan has it so far (auto: 1); the data module takes the final one
    corpus = open_training_data(replace(train.data, batch_size=plan.batch.batch_size),
                                train.data_root, init_from=train.model.init_from,
                                progress=fabric.is_global_zero, log=fabric.print)
    vocab = padded_vocab_size(corpus.min_vocab, train.model.vocab_size)
    model = init_model(train.model, corpus.tokenizer, vocab, min_vocab=corpus.min_vocab)
    try:  # the data's own record of its largest token id, against the model's embeddings
        corpus.check_vocab(model.config.vocab_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return corpus, model


def preflight(train: TrainSchema, plan: RunPlan, resume: ResumePoint | None) -> None:
    """Checks from the config alone, before any heavy work: the evaluation tasks, a resumed
    checkpoint's model, and whether a step fits (a ``model.init_from`` model: once built)."""
    training_tasks(train.eval, train.data_root)  # each of eval.tasks is a task class
    if train.model.init_from:
        return
    vocab = train.model.vocab_size or padded_vocab_size(
        resume.model_config["vocab_size"] if resume
        else VOCAB_BEFORE_DATA.get(train.data.tokenizer, 50257), None)
    model_config = train.model.gpt_config(vocab).to_dict()
    if resume is not None:
        check_resume_matches(resume, model_config, skip=("vocab_size",))
    check_run_fits(plan, model_config)


def apply_cpu_speedups(model: GPT, plan: RunPlan) -> list[str]:
    """``minigpt.cpu.speed_up_training`` for a CPU run unless ``cpu_speedups=false``, before
    compiling or wrapping; logs what it applied."""
    if not plan.cpu_speedups:
        return []
    applied = speed_up_training(model, precision=plan.precision, compiled=plan.compile)
    rank_zero_info(f"cpu speedups: {', '.join(applied) or 'none apply'}")
    return applied


def build_trainables(train: TrainSchema, fabric: Fabric, plan: RunPlan, model: GPT
                     ) -> tuple[ModelWithLoss, dict, dict]:
    """The model wrapped by Fabric, its optimizers and their schedules (both by name)."""
    module = fabric.setup_module(ModelWithLoss(model, plan.compile, fullgraph=not plan.fsdp))
    optim = train.optim
    # The fused kernel steps all parameters of a group at once. Not under fp16: there the grad
    # scaler must unscale the gradients before they are clipped.
    fused = optim.fused and fabric.device.type in ("cuda", "cpu", "xpu", "mps") \
        and not plan.precision.startswith("16")
    optimizers = build_optimizers(module, optim, fused=fused)
    schedulers = {name: schedule_for(o, optim) for name, o in optimizers.items()}
    optimizers = {name: fabric.setup_optimizers(o) for name, o in optimizers.items()}
    return module, optimizers, schedulers


def build_loop(train: TrainSchema, fabric: Fabric, plan: RunPlan, corpus, trainables: tuple,
               run_dir: Path) -> Loop:
    """The loop around the final plan, ``trainables`` (``build_trainables``) and the data
    module of ``corpus`` (``open_training_data``'s) in batches of the final micro-batch."""
    module, optimizers, schedulers = trainables
    config = module.model.config
    data = corpus.data_module(config.context_length, plan.batch.batch_size, seed=train.seed,
                              rank=fabric.global_rank, world_size=fabric.world_size,
                              document_mask=config.document_mask,
                              pin_memory=fabric.device.type == "cuda")
    # The first process of each machine downloads the tasks' items; the others read them.
    with fabric.rank_zero_first(local=True):
        eval_items = training_items(train.eval, Path(train.data_root).expanduser(),
                                    corpus.template)
    try:  # UTF-8 bytes per validation token, for bits per byte (None: a masked loss)
        bytes_per_token = data.bytes_per_token(corpus.tokenizer, train.data.val_tokens)
    except Exception as e:
        rank_zero_warn(f"val/bpb is off: cannot measure bytes per token ({e})")
        bytes_per_token = None
    return Loop(
        fabric, plan, train, module=module, optimizers=optimizers, schedulers=schedulers,
        data=data, checkpoints=CheckpointFiles(fabric, run_dir / "checkpoints"),
        sampler=Sampler(corpus.tokenizer, run_dir / "samples.txt", train.sample, seed=train.seed),
        eval_items=eval_items,
        bytes_per_token=bytes_per_token,
        chat_template=corpus.template,
    )


def start_run_dir(loop: Loop, run_dir: Path, ckpt_path: str | None) -> None:
    """The run directory's config, the loggers' first record, leftovers of a killed run gone."""
    fabric = loop.fabric
    resolved = OmegaConf.to_container(OmegaConf.structured(loop.settings))
    resolved["model"]["vocab_size"] = loop.model.config.vocab_size
    if fabric.is_global_zero:
        run_dir.mkdir(parents=True, exist_ok=True)
        text = OmegaConf.to_yaml(resolved)
        atomic_write(run_dir / "config.yaml", lambda tmp: tmp.write_text(text))
        fabric.print(describe(loop, run_dir, ckpt_path))
    for logger in fabric.loggers:  # the CSV log's config is config.yaml
        started = logger.start(resolved) if hasattr(logger, "start") else None
        if started:
            fabric.print(started)
    removed = loop.checkpoints.remove_leftovers()
    if removed:
        fabric.print(f"removed {len(removed)} temporary checkpoint file(s) a killed run left")


def describe(loop: Loop, run_dir: Path, ckpt_path: str | None) -> str:
    model, tokenizer, plan, fabric = loop.model, loop.sampler.tokenizer, loop.plan, loop.fabric
    return (
        f"run dir: {run_dir}\nmodel: {model.num_params() / 1e6:.2f}M parameters, "
        f"{model.config}\ndata: {loop.data.config.name}, tokenizer {tokenizer.name} (vocab "
        f"{tokenizer.vocab_size}, model vocab {model.config.vocab_size}), "
        f"{loop.data.train_tokens:,} train tokens\nbatch: {plan.batch.describe()}\n"
        f"precision: {plan.precision}, compile: {plan.compile}, activation checkpointing: "
        f"{plan.activation_checkpointing}, devices: {fabric.world_size} "
        f"process(es) on {fabric.device.type}, strategy: {type(fabric.strategy).__name__}"
        + (f"\nresuming from {ckpt_path}" if ckpt_path else "")
    )


def finish(fabric: Fabric, loop: Loop, run_dir: Path) -> dict:
    """The run's summary (also ``summary.json``), after a parameter checksum every rank logs (the
    ranks must agree)."""
    with gathered_parameters(loop.module, recurse=True):
        checksum = sum(float(p.detach().double().sum()) for p in loop.model.parameters())
    log.info(f"rank {fabric.global_rank}: parameter checksum {checksum:.10e}")
    ckpt_dir = run_dir / "checkpoints"
    best = ckpt_dir / "best.ckpt"
    summary = {
        "run_dir": str(run_dir),
        "last": str(ckpt_dir / LAST) if (ckpt_dir / LAST).exists() else None,
        "best": str(best) if best.exists() else None,
        "val_loss": loop.progress.val_loss,
        "steps": loop.progress.global_step,
        "batch": loop.progress.batch,
        **({"target": loop.progress.target} if loop.settings.trainer.target_val_loss is not None
           else {}),
        **loop.progress.eval_metrics,
    }
    if fabric.is_global_zero:
        text = json.dumps(summary, indent=2) + "\n"
        atomic_write(run_dir / "summary.json", lambda tmp: tmp.write_text(text))
        fabric.print(f"done: {summary['steps']} steps, val/loss {summary['val_loss']}, "
                     f"checkpoints in {ckpt_dir}; sample with `python generate.py`")
    return summary


def quiet_warnings() -> None:
    """Silence warnings a user can do nothing about; each filter says why it is safe."""
    # A deprecation inside torch's pytree, raised from Lightning's code, not ours.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    # Lightning advertises its cloud logger on every run, and announces the precision when
    # Fabric is built, before the run's checks (the run's description names the precision).
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_drop_lightning_notes)


def _drop_lightning_notes(record: logging.LogRecord) -> bool:
    message = str(record.msg)
    return not (message.startswith("💡 Tip:") or "Automatic Mixed Precision" in message)


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

