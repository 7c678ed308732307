"""Optimizer math: AdamW parameter groups and the warmup + cosine learning-rate schedule.

Pure functions with tests; the LightningModule only wires them together.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn


def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """Learning rate after ``step`` optimizer steps: linear warmup from lr/warmup_steps to ``lr``
    over ``warmup_steps``, cosine decay to ``min_lr`` at ``decay_steps``, then ``min_lr``."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)  # in [0, 1)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on the weight matrices of ``nn.Linear`` layers only; biases,
    LayerNorm and embeddings (including the LM head tied to the token embedding) get none.

    Decided by module type, not ``p.dim()``, so it also holds for FSDP's flattened shards."""
    embedding_ids = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    decay_ids = {
        id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)
    } - embedding_ids
    decay, no_decay = [], []
    for p in model.parameters():  # yields a tied tensor once
        if p.requires_grad:
            (decay if id(p) in decay_ids else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def adamw_with_schedule(model: nn.Module, optim: dict, *, fused: bool):
    """AdamW over ``param_groups`` and a per-step ``LambdaLR`` following ``lr_at``.

    ``optim``: lr, min_lr, warmup_steps, decay_steps, weight_decay, beta1, beta2, eps. ``fused``
    steps all parameters of a group in one kernel; the caller decides where that is allowed."""
    optimizer = torch.optim.AdamW(
        param_groups(model, optim["weight_decay"]), lr=optim["lr"],
        betas=(optim["beta1"], optim["beta2"]), eps=optim["eps"],
        **({"fused": True} if fused else {}),
    )
    # A partial, so its arguments (not a closure) are inspectable; the step count lives in the
    # scheduler's state and comes back on resume.
    schedule = partial(lr_ratio, lr=optim["lr"], min_lr=optim["min_lr"],
                       warmup_steps=optim["warmup_steps"], decay_steps=optim["decay_steps"])
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def lr_ratio(step: int, *, lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """``lr_at`` as a multiple of ``lr`` (what ``LambdaLR`` wants)."""
    return lr_at(step, lr, min_lr, warmup_steps, decay_steps) / lr
