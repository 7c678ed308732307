"""``data.batch_size=auto``: the largest micro-batch that fits, chosen once when a run starts.

On CUDA it is measured: two forward + backward + optimizer steps of the run's own model,
strategy and optimizers at each candidate size (``minigpt.train.batch_size.largest_that_fits``),
an out-of-memory error caught and the memory released after each, keeping a share of the memory
free. Elsewhere it comes from the preflight's estimate against the memory the process may use.
``trainer.memory_budget`` caps both. With ``data.tokens_per_step`` the micro-batch is rounded
down to divide the rows each process sees per step, and the accumulation is derived from it: one
command line is the same recipe on a small and a large card.

Shape letters: B micro-batch, T context.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from minigpt.errors import ResourceError
from minigpt.train.batch_size import (
    fits_when_tried,
    largest_divisor_at_most,
    largest_that_fits,
)
from minigpt.train.plan import RunPlan
from minigpt.train.preflight import GiB, check_run_fits, memory_limit, plan_estimate

# The largest micro-batch tried without data.tokens_per_step (which bounds it otherwise).
MAX_MICRO_BATCH = 4096
# A size chosen from the estimate keeps this much room above it: the estimate aims to be within
# 15% of the measured peak, so a step that measures above it still fits.
ESTIMATE_HEADROOM = 1.15
# A measured step's peak may use this fraction of the device's memory: the rest is for what a
# few trial steps do not show (the allocator's fragmentation over a long run, other processes).
MEASURED_SHARE = 0.9


@dataclass(frozen=True)
class BatchChoice:
    """The micro-batch ``auto`` chose and why, in words."""

    batch_size: int
    reason: str

    def describe(self) -> str:
        return f"data.batch_size=auto chose {self.batch_size}: {self.reason}"


def choose_from_estimate(plan: RunPlan, model: dict) -> BatchChoice:
    """The largest micro-batch whose estimated step, with ``ESTIMATE_HEADROOM``, fits in the
    memory the process may use (``preflight.memory_limit``); a ``ResourceError`` (the
    preflight's refusal) when not even one row fits."""
    available, where = memory_limit(plan)
    found = largest_that_fits(
        lambda n: plan_estimate(plan, model, n).total * ESTIMATE_HEADROOM <= available,
        plan.rows_per_process or MAX_MICRO_BATCH)
    if not found:
        check_run_fits(plan.with_batch_size(1), model)  # refuses unless 1 fits without headroom
        found = 1
    size = _rounded(plan, found)
    estimate = plan_estimate(plan, model, size).total
    return BatchChoice(size, f"its estimated step, {estimate / GiB:.2f} GiB (+"
                             f"{ESTIMATE_HEADROOM - 1:.0%} headroom), fits the "
                             f"{available / GiB:.2f} GiB of {where}{_rounding(plan, found, size)}")


def choose_by_measuring(fabric, plan: RunPlan, module, optimizers: dict,
                        vocab_size: int) -> BatchChoice:
    """The largest micro-batch whose training step runs on the device with room to spare: two
    steps (forward, backward, a step of each optimizer of ``module``, set up by ``fabric``) on
    random tokens, the second carrying the gradients and optimizer state the first made, whose
    allocator peak stays within ``measured_limit``. The parameters come back as they were, the
    optimizer state is dropped, and the random streams are untouched."""
    device, T = fabric.device, plan.context_length
    saved = [p.detach().to("cpu", copy=True) for p in module.parameters()]
    limit, limit_words = measured_limit(*_cuda_memory(device), plan.memory_budget)

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

    release()  # the peak so far (model set-up) is not the step's
    fits = fits_when_tried(try_step, release, lambda fit: _all_agree(fabric, fit))
    with torch.random.fork_rng(devices=[device]):
        found = largest_that_fits(fits, plan.rows_per_process or MAX_MICRO_BATCH)
    with torch.no_grad():
        for p, value in zip(module.parameters(), saved, strict=True):
            p.copy_(value)
    if not found:
        raise ResourceError(
            f"data.batch_size=auto: not even one row of {T} tokens fits a training step on "
            f"{device} within {limit_words}; recompute activations, shard with trainer=fsdp, "
            "or lower model.context_length")
    size = _rounded(plan, found)
    return BatchChoice(size, f"the largest whose training step, measured on {device}, peaked "
                             f"within {limit_words}{_rounding(plan, found, size)}")


def measured_limit(usable: int, where: str, budget: int | None) -> tuple[int, str]:
    """The allocator peak a measured step may reach, in bytes, and the words that say so:
    ``MEASURED_SHARE`` of ``usable`` (the bytes this process may use on ``where``), or
    ``trainer.memory_budget`` when that is smaller."""
    share = int(usable * MEASURED_SHARE)
    if budget is not None and budget <= share:
        return budget, f"trainer.memory_budget ({budget / GiB:.2f} GiB)"
    return share, (f"{MEASURED_SHARE:.0%} of the {usable / GiB:.2f} GiB free on {where} "
                   "(trainer.memory_budget sets another limit)")


def _cuda_memory(device: torch.device) -> tuple[int, str]:
    """The bytes this process may use on ``device`` (free now, plus what its allocator holds)
    and the device's name."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device), f"{device} ({torch.cuda.get_device_name(device)})"


def _all_agree(fabric, fit: bool) -> bool:
    """Whether the try fit on every process (all take the same size)."""
    if fabric.world_size == 1:
        return fit
    flag = torch.tensor(float(fit), device=fabric.device)
    return bool(fabric.all_reduce(flag, reduce_op="sum") == fabric.world_size)


def _rounded(plan: RunPlan, found: int) -> int:
    rows = plan.rows_per_process
    return largest_divisor_at_most(rows, found) if rows else found


def _rounding(plan: RunPlan, found: int, size: int) -> str:
    if size == found:
        return ""
    return (f"; {found} would fit, rounded down to divide the {plan.rows_per_process} rows per "
            "process of data.tokens_per_step")


def resolve_auto_batch(fabric, loop) -> BatchChoice | None:
    """Under ``data.batch_size=auto``: choose the micro-batch for ``loop``'s run (measured on
    CUDA, estimated elsewhere) and fix it in ``loop.plan`` and its data module's batches;
    None (nothing done) for a micro-batch the config gives."""
    plan = loop.plan
    if not plan.auto_batch:
        return None
    config = loop.model.config
    if fabric.device.type == "cuda":
        choice = choose_by_measuring(fabric, plan, loop.module, loop.optimizers,
                                     config.vocab_size)
    else:
        choice = choose_from_estimate(plan, config.to_dict())
    loop.plan = plan.with_batch_size(choice.batch_size)
    loop.data.batch_size = choice.batch_size  # read when the batches are drawn
    return choice


def keep_global_batch(plan: RunPlan, stored: dict | None) -> tuple[RunPlan, str | None]:
    """On resume: the checkpoint's tokens per step (``stored``: its batch record) when the
    config gives no ``data.tokens_per_step`` and the micro-batch is ``auto`` or differs from the
    checkpoint's, so a new micro-batch changes the accumulation, not the recipe. Returns the
    plan and a line saying so (None when nothing changed)."""
    if plan.tokens_per_step is not None or not stored or "tokens_per_step" not in stored:
        return plan, None
    if plan.batch_size == stored.get("batch_size"):
        return plan, None
    tokens = int(stored["tokens_per_step"])
    return plan.with_tokens_per_step(tokens), (
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
