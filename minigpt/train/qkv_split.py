"""Muon on the queries', keys' and values' weights one at a time, though the model fuses them.

``MultiHeadAttention`` keeps one (q + k + v rows, C) weight for its single projection.
``torch.optim.Muon`` orthogonalizes each parameter it is given as one matrix; the modded-nanogpt
speedrun orthogonalizes the three separately (``optim.muon_split_qkv``). ``QKVViews`` gives Muon
three parameters that are views into the fused weight's storage, so its in-place updates land in
the model, and hands them the matching slices of the fused gradient before each step (an
optimizer step pre-hook); after the step the fused gradient is dropped, since no other optimizer
owns that weight to zero it. The model, its state dict and its checkpoints do not change.
"""

from __future__ import annotations

import torch
from torch import nn

from minigpt.attention import MultiHeadAttention


class QKVViews:
    """The query, key and value rows of one fused ``qkv.weight`` as three parameters."""

    def __init__(self, attention: MultiHeadAttention):
        self.weight = attention.qkv.weight
        kv = attention.num_kv_heads * attention.head_dim
        bounds = [0, attention.d_out, attention.d_out + kv, attention.d_out + 2 * kv]
        self.rows = [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
        # detach() shares the storage: Muon's in-place updates of a view update the weight
        self.views = [nn.Parameter(self.weight.detach()[rows]) for rows in self.rows]

    def share_grads(self) -> None:
        grad = self.weight.grad
        for view, rows in zip(self.views, self.rows, strict=True):
            view.grad = None if grad is None else grad[rows]

    def drop_grads(self) -> None:
        self.weight.grad = None
        for view in self.views:
            view.grad = None


def split_qkv(model: nn.Module) -> list[QKVViews]:
    """``QKVViews`` for every attention layer of ``model``."""
    return [QKVViews(m) for m in model.modules() if isinstance(m, MultiHeadAttention)]


def muon_parameters(matrices: list[nn.Parameter], splits: list[QKVViews]) -> list[nn.Parameter]:
    """``matrices`` in order, each fused qkv weight replaced by its three views."""
    views = {id(s.weight): s.views for s in splits}
    return [v for p in matrices for v in views.get(id(p), [p])]


def hand_over_grads(optimizer: torch.optim.Optimizer, splits: list[QKVViews]) -> None:
    """Before each step of ``optimizer`` the views get their slices of the fused gradients;
    after it the fused gradients are dropped (the next step's accumulate afresh)."""
    def share(*_) -> None:
        for split in splits:
            split.share_grads()

    def drop(*_) -> None:
        for split in splits:
            split.drop_grads()

    if splits:
        optimizer.register_step_pre_hook(share)
        optimizer.register_step_post_hook(drop)
