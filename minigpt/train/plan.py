"""The run's plan: device, precision, compile, CPU speedups, processes and the global batch
(the accumulation derived from ``data.tokens_per_step``; ``data.batch_size=auto`` measured on
CUDA, estimated elsewhere), resolved once before the loop is built. Shape letters: B
micro-batch, T context.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, replace

import torch

from minigpt.config import TrainSchema
from minigpt.config.rules import parse_memory_budget
from minigpt.config.schema import ActivationCheckpointing
from minigpt.errors import ConfigError, ResourceError
from minigpt.train.device import compile_enabled, default_precision, resolve_accelerator
from minigpt.train.memory import (
    ESTIMATE_HEADROOM,
    GiB,
    check_run_fits,
    fits_when_tried,
    largest_divisor_at_most,
    largest_that_fits,
    memory_limit,
    plan_estimate,
)

# The largest micro-batch tried without data.tokens_per_step (which bounds it otherwise).
MAX_MICRO_BATCH = 4096
# A measured step's peak may use this fraction of the device's memory: the rest is for what a
# few trial steps do not show (the allocator's fragmentation over a long run, other processes).
MEASURED_SHARE = 0.9


@dataclass(frozen=True)
class BatchPlan:
    """``batch_size`` x ``context_length`` tokens per micro-batch, ``accumulate`` micro-batches per
    process and step, ``world_size`` processes."""

    batch_size: int
    context_length: int
    accumulate: int
    world_size: int

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.batch_size * self.context_length

    @property
    def tokens_per_step(self) -> int:
        return self.tokens_per_micro_batch * self.accumulate * self.world_size

    def describe(self) -> str:
        return (f"{self.batch_size} x {self.context_length} tokens x {self.accumulate} "
                f"micro-batch(es) x {self.world_size} process(es) = {self.tokens_per_step:,} "
                f"tokens per step")


def micro_batches_per_step(tokens_per_step: int, batch_size: int, context_length: int,
                           world_size: int) -> int:
    """Micro-batches each process accumulates so that all processes together see exactly
    ``tokens_per_step`` tokens per optimizer step; a ``ConfigError`` when that is not whole."""
    per_round = batch_size * context_length * world_size
    if tokens_per_step % per_round:
        near = max(1, round(tokens_per_step / per_round)) * per_round
        raise ConfigError(
            f"data.tokens_per_step={tokens_per_step} is not a multiple of data.batch_size x "
            f"context_length x processes = {batch_size} x {context_length} x {world_size} = "
            f"{per_round}; fix: data.tokens_per_step={near} or another data.batch_size")
    return tokens_per_step // per_round


def batch_plan(tokens_per_step: int | None, accumulate: int, batch_size: int,
               context_length: int, world_size: int) -> BatchPlan:
    """The plan for ``data.tokens_per_step`` (derived accumulation) or, when it is null, for
    ``trainer.accumulate_grad_batches`` as given. Both set and disagreeing is an error."""
    if tokens_per_step is None:
        return BatchPlan(batch_size, context_length, accumulate, world_size)
    derived = micro_batches_per_step(tokens_per_step, batch_size, context_length, world_size)
    if accumulate not in (1, derived):
        raise ConfigError(
            f"trainer.accumulate_grad_batches={accumulate} disagrees with data.tokens_per_step="
            f"{tokens_per_step} (which needs {derived} on {world_size} process(es)); fix: drop "
            "trainer.accumulate_grad_batches, it is derived from data.tokens_per_step")
    return BatchPlan(batch_size, context_length, derived, world_size)


@dataclass(frozen=True)
class RunPlan:
    """Everything about how a run trains that is derived from the config and the machine;
    ``batch`` needs the number of processes, which Fabric knows once built from the rest."""

    accelerator: str  # "cpu", "gpu", or another Lightning accelerator name
    precision: str  # Lightning's name: "bf16-mixed", "16-mixed", "32-true", ...
    compile: bool | str  # True: the loss (forward + LM head + cross-entropy) compiled as one
    # graph; "blocks": each transformer block compiled on its own; False: eager
    cpu_speedups: bool  # minigpt.cpu's modules swapped in (CPU runs only)
    strategy: str  # "auto", "ddp", "fsdp", ...
    num_nodes: int
    max_steps: int
    val_every: int  # optimizer steps between validations (and checkpoints)
    log_every: int  # optimizer steps between metric read-backs
    limit_val_batches: int | float | None  # per process: a count, a fraction, or all
    sharded_checkpoints: bool  # FSDP writing one shard per process
    activation_checkpointing: str  # none | blocks | selective: what each block recomputes
    tokens_per_step: int | None  # data.tokens_per_step, as given
    accumulate: int  # trainer.accumulate_grad_batches, as given
    batch_size: int | str  # data.batch_size: the micro-batch of each process, or "auto"
    context_length: int  # the model's
    memory_budget: int | None = None  # trainer.memory_budget in bytes: a cap on a step's memory
    batch: BatchPlan | None = None  # with_world's (under auto: micro-batch 1 until it is chosen)

    @property
    def world_size(self) -> int:
        return self.batch.world_size

    @property
    def auto_batch(self) -> bool:
        """``data.batch_size=auto``, not chosen yet."""
        return self.batch_size == "auto"

    @property
    def rows_per_process(self) -> int | None:
        """Rows of ``context_length`` tokens each process sees per step under
        ``data.tokens_per_step`` (a micro-batch must divide them); None without it."""
        if self.tokens_per_step is None:
            return None
        return self.tokens_per_step // (self.context_length * self.world_size)

    def with_world(self, world_size: int) -> RunPlan:
        """The plan with its batch for ``world_size`` processes (under ``auto``: micro-batch 1,
        what must fit at the least); a ``ConfigError`` when the tokens per step do not divide."""
        micro = 1 if self.auto_batch else self.batch_size
        return replace(self, batch=batch_plan(self.tokens_per_step, self.accumulate, micro,
                                              self.context_length, world_size))

    def with_batch_size(self, batch_size: int) -> RunPlan:
        """The plan with micro-batch ``batch_size`` (and the accumulation derived from it)."""
        return replace(self, batch_size=batch_size).with_world(self.world_size)

    @property
    def fsdp(self) -> bool:
        return self.strategy == "fsdp"

    @property
    def chunked_loss(self) -> bool:
        """minigpt.cpu's LM-head loss that never holds the full logits (eager, not under fp16)."""
        return self.cpu_speedups and not self.compile and not self.precision.startswith("16")


def resolve_plan(train: TrainSchema, world_size: int | None = None) -> RunPlan:
    """The plan for a training config; with ``world_size``, its batch too (``with_world``)."""
    t = train.trainer
    accelerator = resolve_accelerator(t.accelerator)
    checkpointing = ActivationCheckpointing(t.activation_checkpointing).value
    if checkpointing == "none" and t.fsdp.activation_checkpointing:  # the old name for blocks
        checkpointing = "blocks"
    plan = RunPlan(
        accelerator=accelerator,
        precision=str(t.precision or default_precision(accelerator)),
        compile="blocks" if train.compile == "blocks" else compile_enabled(train.compile,
                                                                           accelerator),
        cpu_speedups=accelerator == "cpu" and train.cpu_speedups is not False,
        strategy=t.strategy,
        num_nodes=t.num_nodes,
        max_steps=t.max_steps,
        val_every=t.val_check_interval,
        log_every=t.log_every_n_steps,
        limit_val_batches=t.limit_val_batches,
        sharded_checkpoints=t.strategy == "fsdp" and t.fsdp.state_dict_type == "sharded",
        activation_checkpointing=checkpointing,
        tokens_per_step=train.data.tokens_per_step,
        accumulate=t.accumulate_grad_batches,
        batch_size=train.data.batch_size,
        context_length=train.model.context_length,
        memory_budget=parse_memory_budget(t.memory_budget),
    )
    return plan if world_size is None else plan.with_world(world_size)


@dataclass(frozen=True)
class BatchChoice:
    """The micro-batch ``auto`` chose and why, in words."""

    batch_size: int
    reason: str

    def describe(self) -> str:
        return f"data.batch_size=auto chose {self.batch_size}: {self.reason}"


def choose_from_estimate(plan: RunPlan, model: dict) -> BatchChoice:
    """The largest micro-batch whose estimated step, with ``ESTIMATE_HEADROOM``, fits in the
    memory the process may use; the preflight's ``ResourceError`` when not even one row fits."""
    available, where = memory_limit(plan)
    found = largest_that_fits(
        lambda n: plan_estimate(plan, model, n).total * ESTIMATE_HEADROOM <= available,
        plan.rows_per_process or MAX_MICRO_BATCH)
    if not found:
        check_run_fits(plan.with_batch_size(1), model)  # refuses unless 1 fits without headroom
        found = 1
    size, rounding = _rounded(plan, found)
    estimate = plan_estimate(plan, model, size).total
    return BatchChoice(size, f"its estimated step, {estimate / GiB:.2f} GiB (+"
                             f"{ESTIMATE_HEADROOM - 1:.0%} headroom), fits the "
                             f"{available / GiB:.2f} GiB of {where}{rounding}")


def choose_by_measuring(fabric, plan: RunPlan, module, optimizers: dict,
                        vocab_size: int) -> BatchChoice:
    """The largest micro-batch whose two training steps on random tokens (``module`` and its
    ``optimizers``, set up by ``fabric``) peak within ``measured_limit``. The parameters come
    back as they were, the optimizer state is dropped, the random streams are untouched."""
    device, T = fabric.device, plan.context_length
    saved = [p.detach().to("cpu", copy=True) for p in module.parameters()]
    free, _ = torch.cuda.mem_get_info(device)  # and what this process's allocator holds
    limit, limit_words = measured_limit(free + torch.cuda.memory_reserved(device),
                                        f"{device} ({torch.cuda.get_device_name(device)})",
                                        plan.memory_budget)

    def try_step(n: int) -> bool:
        x = torch.randint(0, vocab_size, (n, T), device=device)  # (B, T)
        for _ in range(2):  # the second backward adds to the first's gradients (as under
            # gradient accumulation) beside the optimizer state the first step made: the most
            # a later step of the run holds
            fabric.backward(module(x, x))  # the targets' values do not change the memory
            for optimizer in optimizers.values():
                optimizer.step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) <= limit

    def release() -> None:
        for optimizer in optimizers.values():
            optimizer.zero_grad(set_to_none=True)
            optimizer.state.clear()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    def all_agree(fit: bool) -> bool:  # every process takes the same size
        if fabric.world_size == 1:
            return fit
        flag = torch.tensor(float(fit), device=fabric.device)
        return bool(fabric.all_reduce(flag, reduce_op="sum") == fabric.world_size)

    release()  # the peak so far (model set-up) is not the step's
    with torch.random.fork_rng(devices=[device]):
        found = largest_that_fits(fits_when_tried(try_step, release, all_agree),
                                  plan.rows_per_process or MAX_MICRO_BATCH)
    with torch.no_grad():
        for p, value in zip(module.parameters(), saved, strict=True):
            p.copy_(value)
    if not found:
        raise ResourceError(
            f"data.batch_size=auto: not even one row of {T} tokens fits a training step on "
            f"{device} within {limit_words}; recompute activations, shard with trainer=fsdp, "
            "or lower model.context_length")
    size, rounding = _rounded(plan, found)
    return BatchChoice(size, f"the largest whose training step, measured on {device}, peaked "
                             f"within {limit_words}{rounding}")


def measured_limit(usable: int, where: str, budget: int | None) -> tuple[int, str]:
    """The allocator peak a measured step may reach and words saying so: ``MEASURED_SHARE`` of
    ``usable`` (the bytes this process may use on ``where``), or a smaller ``budget``."""
    share = int(usable * MEASURED_SHARE)
    if budget is not None and budget <= share:
        return budget, f"trainer.memory_budget ({budget / GiB:.2f} GiB)"
    return share, (f"{MEASURED_SHARE:.0%} of the {usable / GiB:.2f} GiB free on {where} "
                   "(trainer.memory_budget sets another limit)")


def _rounded(plan: RunPlan, found: int) -> tuple[int, str]:
    """``found`` rounded down to divide the rows per process, and words saying so if it changed."""
    rows = plan.rows_per_process
    size = largest_divisor_at_most(rows, found) if rows else found
    return size, "" if size == found else (
        f"; {found} would fit, rounded down to divide the {rows} rows per process of "
        "data.tokens_per_step")


def choose_batch(plan: RunPlan, fabric, module, optimizers: dict,
                 model: dict) -> tuple[RunPlan, BatchChoice | None]:
    """The final plan and the choice: under ``data.batch_size=auto`` the micro-batch measured on
    CUDA and estimated elsewhere (``model``: the GPTConfig dict); else ``plan`` and None."""
    if not plan.auto_batch:
        return plan, None
    if fabric.device.type == "cuda":
        choice = choose_by_measuring(fabric, plan, module, optimizers, model["vocab_size"])
    else:
        choice = choose_from_estimate(plan, model)
    return plan.with_batch_size(choice.batch_size), choice


def keep_global_batch(plan: RunPlan, stored: dict | None) -> tuple[RunPlan, str | None]:
    """On resume without ``data.tokens_per_step``: the checkpoint's tokens per step (``stored``:
    its batch record) when the micro-batch is ``auto`` or another, so the accumulation changes,
    not the recipe. Returns the plan and a line saying so (None when nothing changed)."""
    if plan.tokens_per_step is not None or not stored or "tokens_per_step" not in stored:
        return plan, None
    if plan.batch_size == stored.get("batch_size"):
        return plan, None
    tokens = int(stored["tokens_per_step"])
    return replace(plan, tokens_per_step=tokens).with_world(plan.world_size), (
        f"resuming with the checkpoint's {tokens:,} tokens per step (data.tokens_per_step is "
        f"not set and data.batch_size={plan.batch_size} differs from its "
        f"{stored.get('batch_size')})")


def batch_record(plan: RunPlan, choice: BatchChoice | None) -> dict:
    """The batch stored with the run (checkpoints, ``summary.json``), read back on resume."""
    batch = plan.batch
    return {"batch_size": batch.batch_size, "accumulate": batch.accumulate,
            "world_size": batch.world_size, "context_length": batch.context_length,
            "tokens_per_step": batch.tokens_per_step,
            "chosen_by": choice.describe() if choice else "data.batch_size"}
