"""Memory: will a training step fit (``estimate_training_memory`` against the memory the
process may use: ``check_run_fits``), the largest size that fits (``largest_that_fits``), and an
out-of-memory error mid-run as one line. Shape letters: B micro-batch, T context, C n_embd,
L n_layer, V vocabulary, P parameters.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from minigpt.checkpoint.format import LAST
from minigpt.config.schema import ActivationCheckpointing
from minigpt.errors import ResourceError, first_line
from minigpt.model import GPTConfig

GiB = 1 << 30
# Activations each block keeps for backward, in elements per token and per unit of C: LayerNorm
# inputs and outputs (4), q/k/v and the attention output (4), the output projection's input (1),
# the MLP's input, hidden pre- and post-GELU (1 + 4 + 4) - a few more counting SDPA's saved
# output. The scores are never stored (SDPA), so there is no T x T term.
ACTIVATION_ELEMENTS_PER_C = 18
# What a block keeps per activation checkpointing mode (minigpt.train.activation_checkpointing):
# all of the above; its input only (blocks); its input and the outputs of its matmuls and
# attention (selective: input 1, q/k/v 3, attention 1, out_proj 1, MLP hidden 4 and output 1).
KEPT_ELEMENTS_PER_C = {"none": ACTIVATION_ELEMENTS_PER_C, "blocks": 1, "selective": 11}
# Rows of logits per chunk in minigpt.cpu.loss (its _CHUNK_ELEMENTS / V).
LOSS_CHUNK_ELEMENTS = 1 << 25


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one training step needs, by kind, and at its peak (``total``)."""

    weights: int
    gradients: int
    optimizer: int
    activations: int  # kept for backward, and one block's worth live in it
    loss: int
    backward_end: int  # held beside the gradients as backward ends

    @property
    def total(self) -> int:
        """Gradients fill in as backward frees the activations, so a step peaks as backward
        starts (every kept activation, the loss's buffers) or as it ends (every gradient)."""
        return self.weights + self.optimizer + max(self.activations + self.loss,
                                                   self.gradients + self.backward_end)

    def describe(self) -> str:
        parts = ", ".join(f"{f.name} {getattr(self, f.name) / GiB:.2f}" for f in fields(self))
        return f"{self.total / GiB:.2f} GiB ({parts})"


def estimate_training_memory(model: GPTConfig | dict, batch_size: int, *,
                             precision: str = "32-true", chunked_loss: bool = False,
                             shards: int = 1,
                             activation_checkpointing: str = "none") -> MemoryEstimate:
    """Peak bytes of one forward + backward + AdamW step of a ``GPTConfig`` (or a dict of some
    of its fields). ``precision``: Lightning's name; ``shards``: the processes FSDP shards over;
    ``chunked_loss``: ``minigpt.cpu``'s LM-head loss (no full (B, T, V) logits);
    ``activation_checkpointing``: ``none``, ``blocks`` or ``selective``."""
    m = model if isinstance(model, GPTConfig) else GPTConfig(**model)
    L, C, V, T = m.n_layer, m.n_embd, m.vocab_size, m.context_length
    P = m.num_params()
    mixed, half_weights = precision.endswith("-mixed"), precision.endswith("-true") and \
        not precision.startswith("32") and not precision.startswith("64")
    weight_bytes = 2 if half_weights else 4
    act_bytes = 2 if (mixed or half_weights) else 4
    tokens = batch_size * T
    weights = P * weight_bytes // shards + (P * 2 if mixed else 0)  # + autocast's half copies
    gradients = P * weight_bytes // shards
    optimizer = 2 * P * weight_bytes // shards  # AdamW: first and second moments
    per_layer = tokens * ACTIVATION_ELEMENTS_PER_C * C * act_bytes
    kept = tokens * KEPT_ELEMENTS_PER_C[ActivationCheckpointing(activation_checkpointing)] * C \
        * act_bytes
    # what every block keeps, plus one block's worth live in backward: its gradients, or its
    # recomputed activations
    activations = L * kept + per_layer
    activations += 4 * tokens * C * 4  # embeddings, final LayerNorm (float32), its gradient
    loss = _loss_bytes(tokens, C, V, act_bytes, chunked_loss)
    # as backward ends: the first block's activations and, with the chunked loss, the head's
    # own (V, C) gradient before it joins the tied embedding's
    backward_end = per_layer + (V * C * 4 if chunked_loss else 0)
    return MemoryEstimate(weights, gradients, optimizer, activations, loss, backward_end)


def _loss_bytes(tokens: int, C: int, V: int, act_bytes: int, chunked: bool) -> int:
    half = act_bytes if act_bytes < 4 else 0  # extra half-precision copies under autocast
    if chunked:  # float32 logits and probabilities of one chunk, plus the (N, C), (V, C) grads
        rows = min(tokens, max(1, LOSS_CHUNK_ELEMENTS // V))
        return rows * V * (8 + half) + tokens * C * 4 + V * C * 4
    # float32 logits (and their half-precision original), the saved log-softmax, the gradient
    # (and its half-precision cast)
    return tokens * V * (12 + 2 * half)


def check_memory(estimate: MemoryEstimate, available: int, where: str, knobs: dict,
                 fits: str = "") -> None:
    """Refuse a step that will not fit, in one line: the estimate, the limit, what would fit
    (``fits``, a phrase) and the knobs (``{name: value}`` of the settings that shrink a step)."""
    if estimate.total <= available:
        return
    settings = ", ".join(f"{k}={v}" for k, v in knobs.items())
    raise ResourceError(
        f"a training step needs about {estimate.describe()} but {where} has "
        f"{available / GiB:.2f} GiB available; " + (f"{fits}; " if fits else "") +
        f"make it smaller: lower {settings}, reach the same "
        "batch with data.tokens_per_step (or trainer.accumulate_grad_batches), shard the model "
        "over devices with "
        f"trainer=fsdp, or recompute activations with {CHECKPOINTING_SETTING}")


# The setting that recomputes each block's activations in backward.
CHECKPOINTING_SETTING = "trainer.activation_checkpointing=blocks"
# A size chosen from the estimate keeps this much room above it: the estimate aims to be within
# 15% of the measured peak, so a step that measures above it still fits.
ESTIMATE_HEADROOM = 1.15


# Vocabulary sizes of the tokenizers, for a preflight before the data (and so the tokenizer)
# exists (the char tokenizer's is found while preparing; a few hundred at most for text in one
# script); GPT-2's for any other.
VOCAB_BEFORE_DATA = {"char": 256, "gpt2": 50257, "r50k_base": 50257, "p50k_base": 50281,
                     "cl100k_base": 100277, "o200k_base": 200019}


def plan_estimate(plan, model: dict, batch_size: int, *,
                  activation_checkpointing: str | None = None) -> MemoryEstimate:
    """``estimate_training_memory`` of a step of the plan (``minigpt.train.plan.RunPlan``) at
    micro-batch ``batch_size``, in the plan's activation checkpointing mode unless given."""
    return estimate_training_memory(
        model, batch_size, precision=plan.precision, chunked_loss=plan.chunked_loss,
        shards=plan.world_size if plan.fsdp else 1,
        activation_checkpointing=activation_checkpointing or plan.activation_checkpointing)


def memory_limit(plan) -> tuple[int, str]:
    """Bytes one process of the plan may use for a step, and where: ``memory_available`` on its
    device (the host's split over the processes sharing it), capped by ``trainer.memory_budget``."""
    on_gpu = plan.accelerator == "gpu" and torch.cuda.is_available()
    available, where = memory_available("cuda" if on_gpu else "cpu")
    processes = max(1, plan.world_size // plan.num_nodes if plan.accelerator == "cpu" else 1)
    where += f" (per process, {processes} processes)" if processes > 1 else ""
    return within_budget(available // processes, where, plan.memory_budget)


def memory_available(device: str) -> tuple[int, str]:
    """Bytes free for new tensors on ``device`` (``cuda[:i]`` or ``cpu``) and its name: a GPU's
    free memory, or the host's available RAM within a container's limit."""
    if device.startswith("cuda"):
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        return (torch.cuda.mem_get_info(index)[0],
                f"GPU {index} ({torch.cuda.get_device_name(index)})")
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f
                             if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    left = cgroup_memory_left()  # a container's limit ends the process before the host is full
    return available if left is None else min(available, left), "this machine's RAM"


def check_run_fits(plan, model: dict) -> None:
    """``check_memory`` for a run's plan and the model it builds (a GPTConfig dict); a refusal
    names the largest micro-batch and the activation checkpointing that would fit."""
    batch_size = plan.batch.batch_size
    estimate = plan_estimate(plan, model, batch_size)
    available, where = memory_limit(plan)
    fits = "" if estimate.total <= available else what_fits(plan, model, available)
    check_memory(estimate, available, where, {
        "data.batch_size": batch_size, "model.context_length": model["context_length"]}, fits)


def what_fits(plan, model: dict, available: int) -> str:
    """A phrase naming what fits in ``available`` bytes at the plan's tokens per step: the
    largest smaller micro-batch, and each activation checkpointing mode that keeps less and
    fits more than the ones before it."""
    batch = plan.batch
    rows = batch.batch_size * batch.accumulate  # per process and step: the sizes that divide them

    def largest(mode: str) -> int:
        found = largest_that_fits(lambda n: plan_estimate(
            plan, model, n, activation_checkpointing=mode).total <= available, batch.batch_size)
        return largest_divisor_at_most(rows, found) if found else 0

    keep = f" data.tokens_per_step={batch.tokens_per_step}"  # the same global batch
    options = []
    smaller = largest(plan.activation_checkpointing)
    if smaller:
        options.append(f"data.batch_size={smaller}{keep}")
    best = smaller
    for mode in FRUGAL_MODES[FRUGAL_MODES.index(plan.activation_checkpointing) + 1:]:
        size = largest(mode)
        if size > best:  # a mode is worth naming when it fits more than the ones before it
            options.append(f"data.batch_size={size}{keep} trainer.activation_checkpointing={mode}")
            best = size
    if not options:
        return "no micro-batch fits on one device, even with activation checkpointing"
    return "it fits with " + ", or with ".join(options)


# Activation checkpointing modes, from the one that keeps the most to the one that keeps least.
FRUGAL_MODES = ("none", "selective", "blocks")


def cgroup_memory_left(root: str | Path = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's control group may still allocate (its limit minus its usage), or
    ``None`` without a limit."""
    root = Path(root)
    for limit_file, usage_file in (("memory.max", "memory.current"),  # cgroup v2
                                   ("memory/memory.limit_in_bytes",  # cgroup v1
                                    "memory/memory.usage_in_bytes")):
        try:
            limit = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:  # v1: "no limit"
            return None
        return max(0, int(limit) - usage)
    return None


def within_budget(available: int, where: str, budget: int | None) -> tuple[int, str]:
    """The smaller of what ``where`` has and ``trainer.memory_budget``, and its name."""
    if budget is not None and budget < available:
        return budget, f"trainer.memory_budget on {where}"
    return available, where


def largest_that_fits(fits: Callable[[int], bool], upper: int) -> int:
    """The largest ``n`` in ``[1, upper]`` with ``fits(n)``, for a ``fits`` that holds up to some
    size and fails above it; 0 when even 1 does not fit. Doubles, then bisects: about 2 log2(n)
    questions, each size asked at most once."""
    if upper < 1 or not fits(1):
        return 0
    good, bad = 1, None  # the largest size known to fit, the smallest known not to
    while (upper + 1 if bad is None else bad) - good > 1:
        candidate = min(2 * good, upper) if bad is None else (good + bad) // 2
        if fits(candidate):
            good = candidate
        else:
            bad = candidate
    return good


def fits_when_tried(try_size: Callable[[int], bool | None],
                    release: Callable[[], None] = lambda: None,
                    agree: Callable[[bool], bool] = lambda fit: fit) -> Callable[[int], bool]:
    """A ``fits(n)`` for ``largest_that_fits``: ``try_size(n)`` fits unless it raises
    ``torch.OutOfMemoryError`` or returns False; ``release()`` runs after every try, once the
    error is gone; ``agree(fit)`` makes every process give the same answer."""

    def fits(n: int) -> bool:
        try:
            fit = try_size(n) is not False
        except torch.OutOfMemoryError:
            fit = False
        release()
        return agree(fit)

    return fits


def largest_divisor_at_most(rows: int, limit: int) -> int:
    """The largest divisor of ``rows`` that is at most ``limit`` (at least 1): a micro-batch
    that accumulates to exactly ``rows`` rows per process."""
    return max(d for d in range(1, max(1, min(rows, limit)) + 1) if rows % d == 0)


# ---- out of memory in the middle of a run -------------------------------------------------------

@contextlib.contextmanager
def out_of_memory_as_resource_error(loop):
    """Around ``loop.fit()``: an out-of-memory error becomes a ``ResourceError`` naming the step,
    the peak memory, what would fit and how to resume."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
            raise
        raise ResourceError(out_of_memory_message(loop, e)) from None


def out_of_memory_message(loop, error: BaseException) -> str:
    plan, step = loop.plan, loop.progress.global_step + 1
    peak, where = peak_memory(loop.fabric.device)
    batch = plan.batch
    size = smaller_batch_size(plan, loop.model.config.to_dict())
    smaller = f"data.batch_size={size} data.tokens_per_step={batch.tokens_per_step}" if size else ""
    fixes = [smaller] if smaller else []
    if plan.activation_checkpointing != "blocks":
        fixes.append(CHECKPOINTING_SETTING)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not plan.fsdp and max(gpus, plan.world_size) > 1:
        fixes.append(f"trainer=fsdp (shards the model over the {max(gpus, plan.world_size)} GPUs)")
    last = loop.checkpoints.directory / LAST
    resume = (f"resume from {last} with `python train.py ckpt_path={last} "
              f"{smaller or '<the settings above>'}`") if last.exists() else \
        "no checkpoint was written yet: start again with the settings above"
    return (f"out of memory during training at step {step} ({first_line(error, 120)}); peak "
            f"{peak / GiB:.2f} GiB ({where}) with data.batch_size={batch.batch_size} "
            f"x {batch.accumulate} micro-batch(es); it would fit with "
            f"{', or '.join(fixes) or 'a smaller model.context_length'}; {resume}")


def smaller_batch_size(plan, model: dict) -> int:
    """The largest micro-batch below the plan's that divides the rows each process sees per step
    and whose estimate, scaled so that the failed micro-batch needed at least all there is, fits
    with ``ESTIMATE_HEADROOM``; 0 when none does."""
    batch = plan.batch
    available, _ = memory_limit(plan)
    failed = plan_estimate(plan, model, batch.batch_size).total
    scale = max(1.0, available / failed)  # the failed step needed at least all there was
    found = largest_that_fits(
        lambda n: plan_estimate(plan, model, n).total * scale * ESTIMATE_HEADROOM <= available,
        batch.batch_size - 1)
    return largest_divisor_at_most(batch.batch_size * batch.accumulate, found) if found else 0


def peak_memory(device: torch.device) -> tuple[int, str]:
    """The process's peak so far: the CUDA allocator's on a GPU, else the resident set's."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), f"allocated on {device}"
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS
    return (kib if sys.platform == "darwin" else kib * 1024), "resident set"
