"""The training loop, written out like nanoGPT's and run by Lightning Fabric (devices, strategy,
precision, loggers). A micro-batch that does not log copies nothing from the device to the host.

Hooks: ``Fabric(callbacks=[...])`` objects may define ``on_train_batch_start(loop, micro)`` and
``on_train_step_end(loop, loss)`` (``loss`` on the device). Shape letters: B batch, T tokens.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
from lightning.fabric import Fabric
from lightning.fabric.utilities import rank_zero_warn
from lightning.fabric.utilities.throughput import Throughput
from torch import nn
from tqdm import tqdm

from minigpt.checkpoint.format import BEST, LAST
from minigpt.checkpoint.write import CheckpointFiles, set_rng_state, training_state
from minigpt.config import SampleSchema, TrainSchema
from minigpt.cpu.blocks import compile_training_forward, is_compiled_for_training
from minigpt.data import TokenDataModule
from minigpt.errors import UserError, first_line
from minigpt.eval.training import tasks_in_training
from minigpt.files import atomic_write
from minigpt.model import GPT, IGNORE_INDEX
from minigpt.sampling import generate
from minigpt.train.device import peak_flops
from minigpt.train.interrupt import StopRequest
from minigpt.train.plan import RunPlan
from minigpt.window import follow_window_schedule


class ModelWithLoss(nn.Module):
    """A GPT and its training objective as one module for Fabric to wrap: (B, T) tokens and
    targets in, the mean loss out; its state dict is the model's prefixed ``model.``.
    ``compile=True`` compiles the loss as one graph (``fullgraph`` unless FSDP splits it) and
    leaves parameter names unprefixed; ``"blocks"`` compiles each block's training call and the
    LM-head loss, the embeddings and final norm staying eager."""

    def __init__(self, model: GPT, compile: bool | str = False, fullgraph: bool = True):
        super().__init__()
        self.model = model
        if compile == "blocks":
            for block in model.blocks:
                compile_training_forward(block)
            head_loss = model.next_token_loss
            if not is_compiled_for_training(head_loss):
                # An instance attribute, as the blocks': the module and its state dict unchanged.
                head_loss.forward = torch.compile(head_loss.forward)
                head_loss.forward.compiled_for_training = True
        whole = compile and compile != "blocks"
        self.loss = torch.compile(model.loss, fullgraph=fullgraph) if whole else model.loss

    def forward(self, idx: torch.Tensor, targets: torch.Tensor,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.loss(idx, targets, document_ids=document_ids)


def clip_gradients(fabric: Fabric, module, grad_clip: float | None,
                   fabric_optimizer=None) -> torch.Tensor:
    """Clip the global gradient norm of ``module`` at ``grad_clip`` (none: inf); return the norm
    before clipping, on the device. Given ``fabric_optimizer`` (FSDP, fp16), Fabric clips."""
    max_norm = grad_clip or math.inf
    if fabric_optimizer is not None:  # the norm over all of FSDP's shards; fp16 unscaled first
        return fabric.clip_gradients(module, fabric_optimizer, max_norm=max_norm,
                                     error_if_nonfinite=False)
    # The same clipping Fabric does elsewhere, summed in the model's parameter order (not the
    # optimizer groups'): the clip factor then rounds alike whatever the optimizers, and a run
    # reproduces the earlier Trainer-based runs to the last bit.
    return torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm, error_if_nonfinite=False)


def optimizer_step(fabric: Fabric, module: nn.Module, optimizers: dict, schedulers: dict,
                   batches, *, accumulate: int = 1, clip_gradients: Callable[[], torch.Tensor],
                   loop: Loop | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """One optimizer step, callable alone (``bench`` times it): ``accumulate`` micro-batches from
    ``batches`` through ``module`` (a ``ModelWithLoss`` set up by ``fabric``), then
    ``clip_gradients()`` and a step of each optimizer and its scheduler. Returns the mean loss and
    the gradient norm (both on the device) and the learning rates used (``lr``, ``lr_<name>``)."""
    step_loss = torch.zeros((), device=fabric.device)
    for micro in range(accumulate):
        x, y, *documents = fabric.to_device(next(batches))  # (B, T) each; document ids if masked
        fabric.call("on_train_batch_start", loop=loop, micro=micro)
        # Gradients are averaged over the processes once per step, on the last micro-batch.
        with fabric.no_backward_sync(module, enabled=micro < accumulate - 1):
            loss = module(x, y, *documents) / accumulate
            fabric.backward(loss)
        step_loss += loss.detach()
    grad_norm = clip_gradients()
    lrs = {}
    for name, optimizer in optimizers.items():
        lrs["lr" if name == "optimizer" else f"lr_{name}"] = optimizer.param_groups[0]["lr"]
        optimizer.step()
        schedulers[name].step()
        optimizer.zero_grad(set_to_none=True)
    return step_loss, grad_norm, lrs


@dataclass
class Progress:
    """Where the run stands: every counter that decides what happens at a step, saved in every
    checkpoint so a resumed run does what the uninterrupted run would."""

    global_step: int = 0
    best_val_loss: float | None = None
    val_loss: float | None = None
    validations: int = 0  # validations so far: HellaSwag runs every eval.every of them
    train_seconds: float = 0.0  # training time so far (validation excluded)
    target: dict | None = None  # what reaching trainer.target_val_loss took, once it has
    eval_metrics: dict = field(default_factory=dict)  # the latest HellaSwag scores
    batch: dict | None = None  # the batch this run trains with (plan.batch_record)

    @classmethod
    def restored(cls, stored: dict, val_every: int) -> Progress:
        """The progress a checkpoint holds; an older one's validations derived from the step."""
        step = int(stored["global_step"])
        validations = stored.get("validations")
        return cls(step, stored.get("best_val_loss"), stored.get("val_loss"),
                   step // val_every if validations is None else int(validations),
                   float(stored.get("train_seconds") or 0.0), stored.get("target"),
                   dict(stored.get("eval_metrics") or {}), stored.get("batch"))


class Loop:
    """A run's training loop; ``fit()`` runs it to ``plan.max_steps``. ``module``: a
    ``ModelWithLoss`` set up by Fabric; ``optimizers`` and ``schedulers`` by name; ``eval_items``:
    the evaluation tasks' items, or None; ``bytes_per_token``: for bits per byte;
    ``chat_template``: a conversation run's template, stored in its checkpoints."""

    def __init__(self, fabric: Fabric, plan: RunPlan, settings: TrainSchema, *,
                 module: nn.Module, optimizers: dict, schedulers: dict, data: TokenDataModule,
                 checkpoints: CheckpointFiles, sampler: Sampler, eval_items: list | None = None,
                 bytes_per_token: float | None = None, chat_template=None):
        self.fabric, self.plan, self.settings = fabric, plan, settings
        self.module, self.optimizers, self.schedulers = module, optimizers, schedulers
        self.data, self.checkpoints, self.sampler = data, checkpoints, sampler
        self.eval_items, self.bytes_per_token = eval_items, bytes_per_token
        self.chat_template = chat_template
        self.progress = Progress()
        self.pending_rng: dict | None = None  # restored once the training batches are ready
        self.stop: StopRequest | None = None
        self.lrs: dict = {}  # the learning rates of the latest step, by name

    @property
    def model(self) -> GPT:
        return self.module.model

    # ---- one optimizer step ---------------------------------------------------------------------
    def train_step(self, batches) -> tuple[torch.Tensor, torch.Tensor]:
        """``plan.batch.accumulate`` micro-batches, then one optimizer step. Returns the step's
        mean loss and the gradient norm before clipping, both still on the device."""
        by_fabric = self.plan.fsdp or self.plan.precision.startswith("16")
        clip = partial(clip_gradients, self.fabric, self.module, self.settings.optim.grad_clip,
                       self.optimizers["optimizer"] if by_fabric else None)
        loss, grad_norm, lrs = optimizer_step(
            self.fabric, self.module, self.optimizers, self.schedulers, batches,
            accumulate=self.plan.batch.accumulate, clip_gradients=clip, loop=self)
        self.lrs.update(lrs)
        return loss, grad_norm

    # ---- the run --------------------------------------------------------------------------------
    def fit(self) -> Progress:
        """Train from ``progress.global_step`` to ``plan.max_steps``: log every
        ``plan.log_every`` steps; validate, sample and checkpoint every ``plan.val_every`` steps
        and at the end; on Ctrl-C or SIGTERM save ``last.ckpt`` after the step and exit."""
        plan, fabric = self.plan, self.fabric
        batches = self.data.train_batches()  # its loader's iterator draws from torch's RNG ...
        if self.pending_rng is not None:  # ... so a resumed run's RNG state goes in after it
            set_rng_state(self.pending_rng)
            self.pending_rng = None
        self.module.train()
        clock = self.clock = TrainingClock(self)
        bar = tqdm(total=plan.max_steps, initial=self.progress.global_step, desc="train",
                   unit="step", dynamic_ncols=True,
                   disable=not (fabric.is_global_zero
                                and self.settings.trainer.enable_progress_bar))
        self.stop = StopRequest(fabric.world_size)
        with self.stop.installed(), bar:
            while self.progress.global_step < plan.max_steps:
                # model.window_schedule: the window follows the step (exact on resume)
                follow_window_schedule(self.model, self.progress.global_step, plan.max_steps)
                loss, grad_norm = self.train_step(batches)
                self.progress.global_step += 1
                step = self.progress.global_step
                fabric.call("on_train_step_end", loop=self, loss=loss)
                logs = step % plan.log_every == 0 or step == plan.max_steps
                if logs:  # the one host sync of a training step, and only of a logging one
                    values = {"train/loss": float(loss), "grad_norm": float(grad_norm)}
                clock.step_done()
                if logs:
                    self.fabric.log_dict({**values, **self.lrs, **clock.rates(step)}, step=step)
                    bar.set_postfix(loss=f"{values['train/loss']:.4f}", refresh=False)
                bar.update(1)
                if step % plan.val_every == 0 or step == plan.max_steps:
                    self.validate_and_checkpoint(bar)
                    clock.restart()  # validation, samples and checkpoints are not training time
                if self.stop.requested():
                    self.save_and_exit()
                if self.progress.target is not None and self.settings.trainer.stop_at_target:
                    break
        return self.progress

    # ---- validation, samples, checkpoints -------------------------------------------------------
    @torch.no_grad()
    def validate(self) -> float:
        """Mean loss per trained target (``IGNORE_INDEX`` targets do not count) over the fixed
        validation batches of all processes: the same for any process count and batch size."""
        fabric, limit = self.fabric, self.plan.limit_val_batches
        loader = self.data.val_dataloader()
        n = len(loader) if limit is None else min(len(loader), limit if isinstance(limit, int)
                                                  else max(1, math.ceil(limit * len(loader))))
        total = torch.zeros(2, dtype=torch.float64, device=fabric.device)  # loss sum, tokens
        self.module.eval()
        for i, batch in enumerate(loader):
            if i == n:
                break
            x, y, *documents = fabric.to_device(batch)  # (B, T) each; document_ids with them
            targets = (y != IGNORE_INDEX).sum()
            loss = self.module(x, y, *documents).double()  # NaN where nothing trains: not counted
            total[0] += torch.where(targets > 0, loss * targets, 0.0)
            total[1] += targets
        self.module.train()
        total = fabric.all_reduce(total, reduce_op="sum")
        return float(total[0] / total[1].clamp(min=1))

    def validate_and_checkpoint(self, bar) -> None:
        """Validate, write the step's checkpoint, then evaluate and sample: auxiliary work that
        fails never costs the training before it."""
        step = self.progress.global_step
        loss = self.validate()
        metrics = {"val/loss": loss, "val/ppl": math.exp(min(loss, 50.0))}
        if self.bytes_per_token:
            metrics["val/bpb"] = loss / math.log(2) / self.bytes_per_token
        self.fabric.log_dict(metrics, step=step)
        if self.fabric.is_global_zero:
            bar.write(f"step {step}: val/loss {loss:.4f}")
        self.check_target(loss, step)
        self.progress.validations += 1
        self.checkpoint(loss)
        if self.eval_items and self.progress.validations % self.settings.eval.every == 0:
            self.evaluate(step)
        self.sample(step)

    def checkpoint(self, loss: float) -> None:
        """``best.ckpt`` (and ``last`` linked to it) when ``loss`` improves, else ``last.ckpt``."""
        progress = self.progress
        improved = progress.best_val_loss is None or loss < progress.best_val_loss
        progress.val_loss = loss
        if improved:
            progress.best_val_loss = loss
        state = self.state()
        if improved:
            self.checkpoints.write(BEST, state)
            self.checkpoints.link_last_to_best()
        else:
            self.checkpoints.write(LAST, state)

    def evaluate(self, step: int) -> None:
        """The tasks of ``eval_items`` (every rank the same numbers; under FSDP with every
        weight gathered for the scorer), logged as ``eval/<task>/<metric>``."""
        try:
            with gathered_parameters(self.module, recurse=True):
                self.progress.eval_metrics = tasks_in_training(
                    self.model, self.sampler.tokenizer, self.eval_items, self.fabric.device,
                    batch_size=self.settings.eval.batch_size, autocast=self.fabric.autocast)
        except Exception as e:  # the step's checkpoint is on disk: say how to continue from it
            last = self.checkpoints.directory / LAST
            raise UserError(
                f"step {step}: the evaluation failed ({first_line(e)}); the "
                f"checkpoint of step {step} is saved: resume with `python train.py "
                f"ckpt_path={last} eval.every=0` (or fix eval.*)") from e
        self.fabric.log_dict(self.progress.eval_metrics, step=step)

    def check_target(self, loss: float, step: int) -> None:
        """At the first validation at or below ``trainer.target_val_loss``: what it took,
        printed, logged (``target/*``) and kept for ``summary.json``."""
        target = self.settings.trainer.target_val_loss
        if target is None or self.progress.target is not None or loss > target:
            return
        reached = self.progress.target = {
            "val_loss": target, "reached": loss, "steps": step,
            "tokens": step * self.plan.batch.tokens_per_step,
            "seconds": round(self.clock.elapsed, 1)}
        self.fabric.log_dict({f"target/{k}": float(v) for k, v in reached.items()
                              if k in ("steps", "tokens", "seconds")}, step=step)
        self.fabric.print(f"target val/loss {target} reached at step {step}: "
                          f"{reached['tokens']:,} tokens, {reached['seconds']} s of training")

    def sample(self, step: int) -> None:
        text = self.sampler.sample(self.model, self.fabric.device, self.fabric.autocast(),
                                   self.module)
        if text is None or not self.fabric.is_global_zero:
            return
        self.fabric.print(f"\n--- sample at step {step} ---\n{text}\n---")
        self.sampler.record(step, text)
        for logger in self.fabric.loggers:
            if hasattr(logger, "log_samples"):
                logger.log_samples(self.sampler.rows)

    def state(self) -> dict:
        self.progress.train_seconds = self.clock.elapsed
        template = self.chat_template
        return training_state(self.module, self.optimizers, self.schedulers, self.data,
                              asdict(self.progress), self.model.config.to_dict(),
                              self.sampler.tokenizer.to_dict(),
                              template.to_dict() if template is not None else None)

    def save_and_exit(self) -> None:
        name, step = self.stop.signal_name, self.progress.global_step
        path = self.checkpoints.write(LAST, self.state())
        self.fabric.print(f"{name}: saved {path} at step {step}; resume with "
                          f"`python train.py ckpt_path={path}`")
        raise SystemExit(self.stop.exit_code)


@contextlib.contextmanager
def gathered_parameters(wrapped: nn.Module | None, recurse: bool = False):
    """Full parameters of an FSDP-wrapped model inside this context (a collective: every rank
    enters it), for calls outside the wrapped forward; anything else as it is. ``recurse=False``
    gathers the root unit's only (each Block unit gathers its own in its forward)."""
    if wrapped is not None and torch.distributed.is_available():  # builds without it exist
        from torch.distributed.fsdp import FullyShardedDataParallel

        root = next((m for m in wrapped.modules() if isinstance(m, FullyShardedDataParallel)), None)
        if root is not None:
            with FullyShardedDataParallel.summon_full_params(root, writeback=False,
                                                             recurse=recurse):
                yield
            return
    yield


class Sampler:
    """Generates from ``sample.prompt`` with its own seeded generator (the training RNG streams
    are untouched), on every rank (sharded models need all ranks in the forward pass)."""

    def __init__(self, tokenizer, path: str | Path, sample_cfg: SampleSchema, seed: int):
        self.tokenizer, self.path, self.cfg, self.seed = tokenizer, Path(path), sample_cfg, seed
        self.rows: list[list] = []  # (step, text) so far, for the loggers' tables
        self.failed = False

    def sample(self, model, device: torch.device, autocast,
               wrapped: nn.Module | None) -> str | None:
        """The sample text, or None when samples are off (``sample.max_new_tokens=0``) or failed
        before (a sample is a nicety: it never stops training)."""
        if self.failed or self.cfg.max_new_tokens <= 0:
            return None
        try:  # generate runs in eval mode and restores the model's mode
            generator = torch.Generator(device=device).manual_seed(self.seed)
            prompt = self.cfg.prompt
            ids = (self.tokenizer.encode(prompt) if prompt else []) or [self.tokenizer.eot_id]
            idx = torch.tensor([ids[-model.config.context_length:]], device=device)  # (1, T)
            with gathered_parameters(wrapped), autocast:
                out = generate(model, idx, self.cfg.max_new_tokens,
                               temperature=self.cfg.temperature, top_k=self.cfg.top_k,
                               generator=generator, vocab_size=self.tokenizer.vocab_size)
            return self.tokenizer.decode(out[0].tolist())
        except Exception as e:
            self.failed = True
            rank_zero_warn(f"sampling failed, samples are off for this run: "
                           f"{type(e).__name__}: {e}")
            return None

    def record(self, step: int, text: str) -> None:
        """Append to ``samples.txt`` (rank 0 calls this), rewritten whole through
        ``atomic_write``: a full disk is one line and keeps the samples so far."""
        earlier = self.path.read_bytes() if self.path.exists() else b""
        added = f"--- step {step} ---\n{text}\n".encode()
        atomic_write(self.path, lambda tmp: tmp.write_bytes(earlier + added))
        self.rows.append([step, text])


class TrainingClock:
    """``loop``'s training time (validation excluded) and tokens, fed at each step to Lightning's
    ``Throughput`` over the last logging interval (MFU where the device's peak is known) and
    read right after a logging step's host sync."""

    def __init__(self, loop: Loop):
        fabric, plan, self.batch = loop.fabric, loop.plan, loop.plan.batch
        peak = loop.settings.peak_flops
        if peak is None and fabric.device.type == "cuda":
            half = plan.precision.startswith(("bf16", "16"))
            peak = peak_flops(fabric.device, torch.bfloat16 if half else torch.float32)
        self.throughput = Throughput(available_flops=peak, world_size=fabric.world_size,
                                     window_size=plan.log_every + 1)
        flops_per_token = loop.model.flops_per_token(self.batch.context_length)
        self.flops_per_step = flops_per_token * self.batch.tokens_per_micro_batch * \
            self.batch.accumulate if flops_per_token else None
        self.elapsed, self.steps = loop.progress.train_seconds, 0  # a resumed run's time so far
        self.throughput.update(time=self.elapsed, batches=0, samples=0, lengths=0)
        self.restart()

    def restart(self) -> None:
        self.last = time.perf_counter()

    def step_done(self) -> None:
        now = time.perf_counter()
        self.elapsed += now - self.last
        self.last = now
        self.steps += 1
        micro = self.steps * self.batch.accumulate  # micro-batches this process ran
        self.throughput.update(time=self.elapsed, batches=self.steps,
                               samples=micro * self.batch.batch_size,
                               lengths=micro * self.batch.tokens_per_micro_batch,
                               flops=self.flops_per_step)

    def rates(self, step: int) -> dict:
        """``tokens`` seen by all processes, and once the window is full ``tokens_per_s`` (all
        processes) and ``mfu`` (where the peak is known)."""
        computed = self.throughput.compute()
        metrics = {"tokens": float(step * self.batch.tokens_per_step)}
        if "device/items_per_sec" in computed:
            metrics["tokens_per_s"] = computed["device/items_per_sec"] * self.batch.world_size
        if "device/mfu" in computed:
            metrics["mfu"] = computed["device/mfu"]
        return metrics
