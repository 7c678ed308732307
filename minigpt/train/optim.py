"""Optimizer math: parameter groups, AdamW alone or Muon for the blocks' matrices with AdamW for
the rest, and the learning-rate schedules (warmup + cosine, warmup-stable-decay).

Pure functions with tests; the run wires them together.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from minigpt.config.schema import OptimSchema
from minigpt.errors import ConfigError
from minigpt.model import GPT, Block
from minigpt.train.qkv_split import hand_over_grads, muon_parameters, split_qkv


def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """Learning rate after ``step`` optimizer steps: linear warmup from lr/warmup_steps to ``lr``
    over ``warmup_steps``, cosine decay to ``min_lr`` at ``decay_steps``, then ``min_lr``."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)  # in [0, 1)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def wsd_lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, decay_steps: int,
              cooldown_fraction: float) -> float:
    """Warmup-stable-decay: the same linear warmup, then ``lr`` held, then a linear cooldown to
    ``min_lr`` over the last ``cooldown_fraction`` of the ``decay_steps`` (reached at
    ``decay_steps``, held after). A run can be extended from any step of its stable phase."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_lr
    cooldown_start = max(warmup_steps, decay_steps - math.ceil(cooldown_fraction * decay_steps))
    if step < cooldown_start:
        return lr
    progress = (step - cooldown_start) / max(1, decay_steps - cooldown_start)  # in [0, 1)
    return lr + (min_lr - lr) * progress


SCHEDULES = {"cosine": lr_at, "wsd": wsd_lr_at}


def lr_ratio(step: int, *, schedule: str = "cosine", lr: float, **shape) -> float:
    """The schedule's learning rate as a multiple of ``lr`` (what ``LambdaLR`` wants)."""
    return SCHEDULES[schedule](step, lr, **shape) / lr


def as_optim(optim: OptimSchema | dict) -> OptimSchema:
    """``optim`` as an ``OptimSchema`` (a dict of its fields is taken too, for scripts)."""
    return OptimSchema(**optim) if isinstance(optim, dict) else optim


def schedule_for(optimizer: torch.optim.Optimizer,
                 optim: OptimSchema | dict) -> torch.optim.lr_scheduler.LambdaLR:
    """A per-step ``LambdaLR`` of ``optim.schedule``; each group's own learning rate is the peak.
    A partial, so its arguments (not a closure) are inspectable; the step count lives in the
    scheduler's state and comes back on resume."""
    o = as_optim(optim)
    shape = {"min_lr": o.min_lr, "warmup_steps": o.warmup_steps, "decay_steps": o.decay_steps}
    if o.schedule == "wsd":
        shape["cooldown_fraction"] = o.cooldown_fraction
    # min_lr is given for optim.lr; the ratio makes it the same fraction of every group's peak
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, partial(lr_ratio, schedule=o.schedule, lr=o.lr, **shape))


def param_groups(model: nn.Module, weight_decay: float, exclude: set[int] = frozenset(), *,
                 embedding_lr: float | None = None, head_lr: float | None = None) -> list[dict]:
    """AdamW groups: weight decay on the weight matrices of ``nn.Linear`` layers only; biases,
    norms, embeddings and the LM head (tied to the token embedding or not: an untied head is
    the embedding's mirror and is not decayed either) get none.
    ``exclude``: ids of parameters another optimizer steps. ``embedding_lr`` / ``head_lr``: the
    embeddings and an untied head in groups of their own with that peak lr (None: the
    optimizer's lr, in the no-decay group, so older checkpoints' two groups still load).

    Decided by module type, not ``p.dim()``, so it also holds for FSDP's flattened shards."""
    embedding_ids = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    head_ids = {id(m.lm_head.weight) for m in model.modules() if isinstance(m, GPT)}
    decay_ids = {
        id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)
    } - embedding_ids - head_ids
    own_lr = []  # (parameter ids, peak lr): the groups with an lr of their own
    if embedding_lr is not None:
        own_lr.append((embedding_ids, embedding_lr))
    if head_lr is not None:
        own_lr.append((head_ids - embedding_ids, head_lr))
    decay, no_decay, own = [], [], [[] for _ in own_lr]
    for p in model.parameters():  # yields a tied tensor once
        if not p.requires_grad or id(p) in exclude:
            continue
        group = next((g for g, (ids, _) in zip(own, own_lr, strict=True) if id(p) in ids), None)
        if group is None:
            group = decay if id(p) in decay_ids else no_decay
        group.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ] + [{"params": params, "weight_decay": 0.0, "lr": lr}
         for params, (_, lr) in zip(own, own_lr, strict=True) if params]


def block_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The 2-D weights of the linear layers inside the transformer blocks (attention and MLP
    projections): what Muon orthogonalizes. Embeddings, the LM head, norms and biases are not."""
    found, seen = [], set()
    for block in (m for m in model.modules() if isinstance(m, Block)):
        for layer in (m for m in block.modules() if isinstance(m, nn.Linear)):
            if layer.weight.ndim == 2 and id(layer.weight) not in seen:
                seen.add(id(layer.weight))
                found.append(layer.weight)
    return found


def adamw(model: nn.Module, optim: OptimSchema, *, fused: bool,
          exclude: set[int] = frozenset()):
    """AdamW over ``param_groups``. ``fused`` steps all parameters of a group in one kernel; the
    caller decides where that is allowed."""
    return torch.optim.AdamW(
        param_groups(model, optim.weight_decay, exclude, embedding_lr=optim.embedding_lr,
                     head_lr=optim.head_lr), lr=optim.lr,
        betas=(optim.beta1, optim.beta2), eps=optim.eps,
        **({"fused": True} if fused else {}),
    )


def build_optimizers(model: nn.Module, optim: OptimSchema | dict, *, fused: bool) -> dict:
    """``{"optimizer": AdamW}`` for ``optim.name=adamw``; for ``muon`` also ``{"muon": Muon}`` over
    ``block_matrices`` (its own lr, momentum and weight decay; ``muon_split_qkv``: queries, keys
    and values as three matrices, ``minigpt.train.qkv_split``), AdamW keeping the rest."""
    optim = as_optim(optim)
    if optim.name != "muon":
        return {"optimizer": adamw(model, optim, fused=fused)}
    muon_class = getattr(torch.optim, "Muon", None)
    if muon_class is None:
        raise ConfigError(f"optim=muon needs torch.optim.Muon (torch 2.9 or later; this is "
                          f"torch {torch.__version__}): upgrade torch or train with optim=adamw")
    matrices = block_matrices(model)
    splits = split_qkv(model) if optim.muon_split_qkv else []
    muon = muon_class(muon_parameters(matrices, splits), lr=optim.muon_lr,
                      weight_decay=optim.muon_weight_decay, momentum=optim.muon_momentum,
                      nesterov=True, adjust_lr_fn=optim.muon_adjust_lr)
    hand_over_grads(muon, splits)
    rest = adamw(model, optim, fused=fused, exclude={id(p) for p in matrices})
    return {"optimizer": rest, "muon": muon}


def check_muon_runs(optim_name: str, strategy: str, precision: str) -> None:
    """Muon where it cannot run: a one-line error naming the way out."""
    if optim_name != "muon":
        return
    if strategy == "fsdp":
        raise ConfigError("optim=muon does not run under trainer=fsdp (FSDP hands the optimizer "
                          "flattened shards, not the matrices Muon orthogonalizes); use "
                          "trainer=ddp, or optim=adamw with FSDP")
    if precision.startswith("16"):
        raise ConfigError(f"optim=muon does not run with trainer.precision={precision} (one "
                          "gradient scaler for two optimizers); use bf16-mixed or 32-true")


def adamw_with_schedule(model: nn.Module, optim: OptimSchema | dict, *, fused: bool):
    """AdamW over ``param_groups`` and its per-step schedule (``schedule_for``)."""
    optimizer = adamw(model, as_optim(optim), fused=fused)
    return optimizer, schedule_for(optimizer, optim)
