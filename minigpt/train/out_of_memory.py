"""Out of memory in the middle of a run, answered in one line: the step, the peak, the settings
that would fit, and the command that resumes from the last checkpoint (which the failed step
never touched: checkpoints are written whole, between steps)."""

from __future__ import annotations

import contextlib
import resource
import sys

import torch

from minigpt.checkpoint.format import LAST
from minigpt.errors import ResourceError, first_line
from minigpt.train.batch_size import largest_divisor_at_most, largest_that_fits
from minigpt.train.preflight import CHECKPOINTING_SETTING, GiB, memory_limit, plan_estimate

# The smaller micro-batch keeps this much room below the limit: the step that failed showed
# the estimate is short on this machine.
HEADROOM = 1.15


def is_out_of_memory(error: BaseException) -> bool:
    """A CUDA out-of-memory error, or the CPU allocator giving up."""
    return isinstance(error, torch.OutOfMemoryError) or \
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


@contextlib.contextmanager
def out_of_memory_as_resource_error(loop):
    """Around ``loop.fit()``: an out-of-memory error becomes a ``ResourceError`` (exit status 2
    from ``train.py``) whose one line names the step, the peak memory, what would fit and how
    to resume."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        message = out_of_memory_message(loop, e)
        raise ResourceError(message) from None


def out_of_memory_message(loop, error: BaseException) -> str:
    plan, step = loop.plan, loop.progress.global_step + 1
    peak, where = peak_memory(loop.fabric.device)
    batch = plan.batch
    fixes = []
    smaller = smaller_batch_size(plan, loop.model.config.to_dict())
    if smaller:
        fixes.append(f"data.batch_size={smaller} data.tokens_per_step={batch.tokens_per_step}")
    if plan.activation_checkpointing != "blocks":
        fixes.append(CHECKPOINTING_SETTING)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not plan.fsdp and max(gpus, plan.world_size) > 1:
        fixes.append(f"trainer=fsdp (shards the model over the {max(gpus, plan.world_size)} GPUs)")
    last = loop.checkpoints.directory / LAST
    resume = (f"resume from {last} with `python train.py ckpt_path={last} "
              + (f"data.batch_size={smaller} data.tokens_per_step={batch.tokens_per_step}`"
                 if smaller else "<the settings above>`")) if last.exists() else \
        "no checkpoint was written yet: start again with the settings above"
    return (f"out of memory during training at step {step} ({first_line(error, 120)}); peak "
            f"{peak / GiB:.2f} GiB ({where}) with data.batch_size={batch.batch_size} "
            f"x {batch.accumulate} micro-batch(es); it would fit with "
            f"{', or '.join(fixes) or 'a smaller model.context_length'}; {resume}")


def smaller_batch_size(plan, model: dict) -> int:
    """The largest micro-batch below the plan's that still divides the rows each process sees
    per step and whose step fits, from the preflight's estimate scaled up so that the micro-
    batch that failed needs at least the memory there is; 0 when none does."""
    batch = plan.batch
    available, _ = memory_limit(plan)
    failed = plan_estimate(plan, model, batch.batch_size).total
    scale = max(1.0, available / failed)  # the failed step needed at least all there was
    found = largest_that_fits(
        lambda n: plan_estimate(plan, model, n).total * scale * HEADROOM <= available,
        batch.batch_size - 1)
    return largest_divisor_at_most(batch.batch_size * batch.accumulate, found) if found else 0


def peak_memory(device: torch.device) -> tuple[int, str]:
    """The process's peak so far: the CUDA allocator's on a GPU, else the resident set's."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), f"allocated on {device}"
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS
    return (kib if sys.platform == "darwin" else kib * 1024), "resident set"
