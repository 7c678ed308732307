"""The run's plan, resolved once: device, precision, compile, CPU speedups, processes and the
global batch. The memory preflight, the CPU speedups, the loop and the run's description all read
this one object, so no two of them can derive a setting differently.

``data.tokens_per_step`` is the recipe's batch in tokens (nanoGPT's ~0.5M for GPT-2 small). The
gradient accumulation that reaches it is derived here from the micro-batch, the context and the
number of processes, so one command line trains the same recipe on 1, 8 or 64 GPUs.
``data.batch_size=auto`` leaves the micro-batch open until the run has measured (or estimated)
what fits (``minigpt.train.auto_batch``); ``with_batch_size`` then fixes it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from minigpt.config import TrainerSchema, TrainSchema
from minigpt.config.rules import parse_memory_budget
from minigpt.config.schema import ActivationCheckpointing
from minigpt.errors import ConfigError
from minigpt.train.device import compile_enabled, default_precision, resolve_accelerator


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
    """Everything about how a run trains that is derived from the config and the machine. The
    batch needs the number of processes, which Fabric knows once built from the rest:
    ``resolve_plan`` leaves it out until ``with_world`` adds it, once."""

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
        """The plan with its batch for ``world_size`` processes; a ``ConfigError`` when the tokens
        per step do not divide. Under ``auto`` the batch holds micro-batch 1 (what must fit at
        the least) until ``with_batch_size``."""
        micro = 1 if self.auto_batch else self.batch_size
        return replace(self, batch=batch_plan(self.tokens_per_step, self.accumulate, micro,
                                              self.context_length, world_size))

    def with_batch_size(self, batch_size: int) -> RunPlan:
        """The plan with micro-batch ``batch_size`` (and the accumulation derived from it)."""
        return replace(self, batch_size=batch_size).with_world(self.world_size)

    def with_tokens_per_step(self, tokens_per_step: int) -> RunPlan:
        """The plan reaching ``tokens_per_step`` tokens per step, as ``data.tokens_per_step``
        would (a resume keeping its checkpoint's global batch)."""
        plan = replace(self, tokens_per_step=tokens_per_step)
        return plan if self.batch is None else plan.with_world(self.world_size)

    @property
    def fsdp(self) -> bool:
        return self.strategy == "fsdp"

    @property
    def chunked_loss(self) -> bool:
        """minigpt.cpu's LM-head loss that never holds the full logits (eager, not under fp16)."""
        return self.cpu_speedups and not self.compile and not self.precision.startswith("16")


def checkpointing_mode(trainer: TrainerSchema) -> str:
    """``trainer.activation_checkpointing``'s value; the old ``trainer.fsdp.activation_checkpointing
    =true`` means ``blocks``."""
    mode = ActivationCheckpointing(trainer.activation_checkpointing).value
    return "blocks" if mode == "none" and trainer.fsdp.activation_checkpointing else mode


def resolve_plan(train: TrainSchema, world_size: int | None = None) -> RunPlan:
    """The plan for a training config; with ``world_size``, its batch too (``with_world``)."""
    t = train.trainer
    accelerator = resolve_accelerator(t.accelerator)
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
        activation_checkpointing=checkpointing_mode(t),
        tokens_per_step=train.data.tokens_per_step,
        accumulate=t.accumulate_grad_batches,
        batch_size=train.data.batch_size,
        context_length=train.model.context_length,
        memory_budget=parse_memory_budget(t.memory_budget),
    )
    return plan if world_size is None else plan.with_world(world_size)
