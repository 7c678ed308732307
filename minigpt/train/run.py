"""The body of ``train.py``: a composed Hydra config in, a trained run directory out.

``run(cfg)`` checks the whole config first (one message listing every bad value), resolves the
run's plan once (``minigpt.train.plan``), checks that a step fits in memory, launches the
processes through Lightning Fabric, prepares the data, sizes the model from the tokenizer, and
runs the loop (``minigpt.train.loop``). ``train.py`` is only the ``@hydra.main`` wrapper around
it, so tests call ``run`` in-process on a config from Hydra's compose API.

Run directory layout: ``config.yaml`` (resolved), ``checkpoints/{last,best}.ckpt``,
``samples.txt``, ``csv/`` and ``wandb/`` logs, ``summary.json``.
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

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
from minigpt.train.loop import Loop, ModelWithLoss, Progress
from minigpt.train.memory import check_run_fits, out_of_memory_as_resource_error, vocab_before_data
from minigpt.train.model_init import init_model, padded_vocab_size
from minigpt.train.optim import build_optimizers, check_optimizers_run, schedule_for
from minigpt.train.plan import RunPlan, batch_record, choose_batch, for_world, resolve_plan
from minigpt.train.run_dir import hold_run_dir, remove_unstarted
from minigpt.train.sample import Sampler, gathered_parameters

log = logging.getLogger(__name__)


def run(cfg: TrainSchema | DictConfig, run_dir: str | Path | None = None,
        callbacks: list | tuple = ()) -> dict:
    """Train as ``cfg`` says (a ``TrainSchema``, or a composed config, converted once); return
    ``{"run_dir", "last", "best", "val_loss", "steps"}``.

    ``run_dir`` defaults to Hydra's run directory; ``callbacks`` are Fabric callbacks (see
    ``minigpt.train.loop`` for the hooks the loop calls). A failure before the first training
    step leaves nothing behind in ``run_dir``."""
    train = typed(cfg, TrainSchema)
    run_dir = _run_dir(run_dir).resolve()
    writer = hold_run_dir(run_dir, train.ckpt_path)  # one process writes into a run directory
    started = []
    try:
        return _run(train, run_dir, list(callbacks) + [_FirstStep(started)])
    except BaseException:
        if not started and rank_zero_only.rank == 0:
            remove_unstarted(run_dir)
        raise
    finally:
        writer.release()


class _FirstStep:
    """Notes that training started (a Fabric callback)."""

    def __init__(self, started: list):
        self.started = started

    def on_train_batch_start(self, loop, micro):
        self.started.append(True)


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
    plan, kept = for_world(plan, fabric.world_size, resume.batch if resume else None)
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
    setup = Setup(corpus, model, corpus.data_module(
        model.config.context_length, plan.batch.batch_size, seed=train.seed,
        rank=fabric.global_rank, world_size=fabric.world_size,
        document_mask=model.config.document_mask, pin_memory=fabric.device.type == "cuda"))
    loop = build_loop(train, fabric, plan, setup, (module, optimizers, schedulers), run_dir)
    if resume is not None:
        restored = restore(fabric, resume, module, optimizers, schedulers, setup.data)
        loop.progress = Progress.restored(restored, plan.val_every)
        loop.pending_rng = restored["rng"]
    loop.progress.batch = batch_record(plan, choice)
    for line in (kept, choice and choice.describe()):
        if line:
            fabric.print(line)
    start_run_dir(train, fabric, setup, plan, run_dir, ckpt_path)
    status = "failed"  # what the loggers are told: a crash, or an interrupt's exit
    try:
        with out_of_memory_as_resource_error(loop):
            loop.fit()
        if plan.sharded_checkpoints:
            consolidate_at_end(fabric, run_dir / "checkpoints")
        status = "success"
    finally:
        for logger in fabric.loggers:
            logger.finalize(status)
    summary = finish(fabric, loop, run_dir)
    if owns_process_group:
        end_process_group(fabric)
    return summary


@dataclass
class Setup:
    """What a run trains: its data as its source makes it (``open_training_data``: the
    tokenizer, a chat template or None), the model sized from it, and the data module."""

    corpus: object  # minigpt.data.datamodule.PreparedTokens or minigpt.data.chat.Conversations
    model: GPT
    data: object  # the corpus's data module, in batches of the run's micro-batch

    @property
    def tokenizer(self):
        return self.corpus.tokenizer


def prepare(train: TrainSchema, plan: RunPlan, fabric: Fabric) -> tuple[object, GPT]:
    """Data first: the model's vocabulary comes from the prepared data's tokenizer (and a chat
    template's special tokens). Every rank calls this; preparation is locked and idempotent (one
    prepares, the rest reuse). Returns the data (``open_training_data``) and the model."""
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
    """What can be checked from the config alone, before any heavy work: a resumed checkpoint's
    model against the configured one, and whether a training step fits in memory. A model from
    ``model.init_from`` is only known once built (``run`` checks it then)."""
    training_tasks(train.eval, train.data_root)  # each of eval.tasks is a task class
    if train.model.init_from:
        return
    vocab = train.model.vocab_size or padded_vocab_size(
        resume.model_config["vocab_size"] if resume else vocab_before_data(train.data.tokenizer),
        None)
    model_config = train.model.gpt_config(vocab).to_dict()
    if resume is not None:
        check_resume_matches(resume, model_config, skip=("vocab_size",))
    check_run_fits(plan, model_config)


def apply_cpu_speedups(model: GPT, plan: RunPlan) -> list[str]:
    """``minigpt.cpu.speed_up_training`` for a CPU run unless ``cpu_speedups=false``; logs what
    it applied. Called once, after the model is built and before compiling or FSDP wrapping."""
    if not plan.cpu_speedups:
        return []
    applied = speed_up_training(model, precision=plan.precision, compiled=plan.compile)
    rank_zero_info(f"cpu speedups: {', '.join(applied) or 'none apply'}")
    return applied


def build_trainables(train: TrainSchema, fabric: Fabric, plan: RunPlan, model: GPT
                     ) -> tuple[ModelWithLoss, dict, dict]:
    """The model wrapped by Fabric (DDP/FSDP, precision), its optimizers and their schedules
    (both by name)."""
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


def build_loop(train: TrainSchema, fabric: Fabric, plan: RunPlan, setup: Setup, trainables: tuple,
               run_dir: Path) -> Loop:
    """The loop around the run's final plan, its data and ``trainables`` (``build_trainables``),
    with the evaluation tasks' items."""
    module, optimizers, schedulers = trainables
    # The first process of each machine downloads the tasks' items into the cache; the others
    # read them.
    with fabric.rank_zero_first(local=True):
        eval_items = training_items(train.eval, Path(train.data_root).expanduser(),
                                    setup.corpus.template)
    return Loop(
        fabric, plan, train, module=module, optimizers=optimizers, schedulers=schedulers,
        data=setup.data, checkpoints=CheckpointFiles(fabric, run_dir / "checkpoints"),
        sampler=Sampler(setup.tokenizer, run_dir / "samples.txt", train.sample, seed=train.seed),
        eval_items=eval_items,
        bytes_per_token=bytes_per_token(setup.data, setup.tokenizer, train.data.val_tokens),
        chat_template=setup.corpus.template,
    )


def start_run_dir(train: TrainSchema, fabric: Fabric, setup: Setup, plan: RunPlan,
                  run_dir: Path, ckpt_path: str | None) -> None:
    """The run directory's config, the loggers' first record, leftovers of a killed run gone."""
    resolved = OmegaConf.to_container(OmegaConf.structured(train))
    resolved["model"]["vocab_size"] = setup.model.config.vocab_size
    if fabric.is_global_zero:
        run_dir.mkdir(parents=True, exist_ok=True)
        text = OmegaConf.to_yaml(resolved)
        atomic_write(run_dir / "config.yaml", lambda tmp: tmp.write_text(text))
        fabric.print(describe(run_dir, setup, plan, fabric, ckpt_path))
    for logger in fabric.loggers:  # the CSV log's config is config.yaml
        started = logger.start(resolved) if hasattr(logger, "start") else None
        if started:
            fabric.print(started)
    removed = CheckpointFiles(fabric, run_dir / "checkpoints").remove_leftovers()
    if removed:
        fabric.print(f"removed {len(removed)} temporary checkpoint file(s) a killed run left")


def describe(run_dir: Path, setup: Setup, plan: RunPlan, fabric: Fabric, ckpt_path) -> str:
    model, tokenizer = setup.model, setup.tokenizer
    return (
        f"run dir: {run_dir}\nmodel: {model.num_params() / 1e6:.2f}M parameters, "
        f"{model.config}\ndata: {setup.data.config.name}, tokenizer {tokenizer.name} (vocab "
        f"{tokenizer.vocab_size}, model vocab {model.config.vocab_size}), "
        f"{setup.data.train_tokens:,} train tokens\nbatch: {plan.batch.describe()}\n"
        f"precision: {plan.precision}, compile: {plan.compile}, activation checkpointing: "
        f"{plan.activation_checkpointing}, devices: {fabric.world_size} "
        f"process(es) on {fabric.device.type}, strategy: {type(fabric.strategy).__name__}"
        + (f"\nresuming from {ckpt_path}" if ckpt_path else "")
    )


def consolidate_at_end(fabric: Fabric, ckpt_dir: Path) -> None:
    """After training with sharded FSDP checkpoints: the model-only ``model.ckpt`` consolidated
    from the final ``last.ckpt`` by rank 0, for ``generate.py``."""
    if fabric.is_global_zero:
        fabric.print(f"consolidated the model into {consolidate(ckpt_dir / LAST, ckpt_dir / MODEL_FILE)}")
    fabric.barrier()


def finish(fabric: Fabric, loop: Loop, run_dir: Path) -> dict:
    """The run's summary (also ``summary.json``), after a parameter checksum every rank logs to
    its own file: under DDP (and FSDP, gathered) the ranks must agree."""
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


def end_process_group(fabric: Fabric) -> None:
    """Destroy the process group this run started, once every rank is done with it.

    Lightning does so at exit for NCCL only. A gloo group left to interpreter shutdown can abort
    the process (SIGABRT, "terminate called without an active exception") after a run that
    succeeded: its worker threads still hold tensors. Called only after success: after a failure
    another rank may still be inside a collective, and the barrier would hang."""
    if torch.distributed.is_initialized():  # Fabric starts none for one process
        fabric.barrier()
        torch.distributed.destroy_process_group()


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


def _run_dir(run_dir) -> Path:
    if run_dir is not None:
        return Path(run_dir)
    return Path(HydraConfig.get().runtime.output_dir)


def bytes_per_token(data, tokenizer, budget: int) -> float | None:
    """The data module's UTF-8 bytes per token (for bits per byte; None for a masked loss), or
    None with a warning when they cannot be measured."""
    try:
        return data.bytes_per_token(tokenizer, budget)
    except Exception as e:
        rank_zero_warn(f"val/bpb is off: cannot measure bytes per token ({e})")
        return None
