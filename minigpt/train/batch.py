"""The global batch: tokens per optimizer step, and the micro-batches that make it up.

``data.tokens_per_step`` is the recipe's batch in tokens (nanoGPT's ~0.5M for GPT-2 small). The
gradient accumulation that reaches it is derived here from the micro-batch, the context and the
number of processes, so one command line trains the same recipe on 1, 8 or 64 GPUs. Intervals
(``trainer.val_check_interval``) count optimizer steps; Lightning counts micro-batches, so they
are converted here too. Pure functions with tests; ``run`` applies them to the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

from minigpt.train.config import ConfigError

# Lightning's fit-loop counters of training batches, rewritten when a resumed run accumulates a
# different number of micro-batches per step than the run that wrote the checkpoint.
_BATCH_PROGRESS = "epoch_loop.batch_progress"


@dataclass(frozen=True)
class BatchPlan:
    """``batch_size`` x ``context_length`` tokens per micro-batch, ``accumulate`` micro-batches per
    process and step, ``world_size`` processes."""

    batch_size: int
    context_length: int
    accumulate: int
    world_size: int

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.context_length * self.accumulate * self.world_size

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


def batches_between_checks(val_check_interval, accumulate: int):
    """``trainer.val_check_interval`` in optimizer steps -> Lightning's count of micro-batches.
    Non-integers (a time such as ``"00:01:00:00"``) pass through unchanged."""
    if isinstance(val_check_interval, int) and not isinstance(val_check_interval, bool):
        return val_check_interval * accumulate
    return val_check_interval


def rescale_batch_progress(loops: dict, global_step: int, accumulate: int) -> bool:
    """Make a checkpoint's fit-loop batch counters say ``global_step`` optimizer steps of
    ``accumulate`` micro-batches each, in place; True if anything changed.

    Lightning decides when to step the optimizer and when to validate from these counters
    (``ready % accumulate_grad_batches``). A checkpoint written with another accumulation (another
    number of processes under ``data.tokens_per_step``) would otherwise step mid-batch."""
    progress = loops.get("fit_loop", {}).get(_BATCH_PROGRESS)
    if not progress or "processed" not in progress.get("total", {}):
        return False
    # Saved after a step's last micro-batch was processed; the other counters keep their offsets
    # from that one, so Lightning's own restart logic (ready vs. completed) is unchanged.
    delta = global_step * accumulate - progress["total"]["processed"]
    if delta == 0:
        return False
    for part in ("total", "current"):
        counters = progress.get(part, {})
        for key in ("ready", "started", "processed", "completed"):
            if key in counters:
                counters[key] += delta
    return True
