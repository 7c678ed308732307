"""Optimizers: parameter groups, one optimizer class for the model or one for the blocks'
matrices beside another for the rest (AdamW; Muon with ``optim=muon``; any
``torch.optim.Optimizer`` by dotted path), and the learning-rate schedules.
"""

from __future__ import annotations

import inspect
import math
from functools import partial

import torch
from torch import nn

from minigpt.attention import MultiHeadAttention
from minigpt.config.schema import OptimSchema
from minigpt.dotted import extension_point
from minigpt.errors import ConfigError
from minigpt.model import GPT, Block


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
    """A per-step ``LambdaLR`` of ``optim.schedule`` (a partial, so inspectable; its step count
    comes back on resume); each group's own learning rate is the peak."""
    o = as_optim(optim)
    shape = {"min_lr": o.min_lr, "warmup_steps": o.warmup_steps, "decay_steps": o.decay_steps}
    if o.schedule == "wsd":
        shape["cooldown_fraction"] = o.cooldown_fraction
    # min_lr is given for optim.lr; the ratio makes it the same fraction of every group's peak
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, partial(lr_ratio, schedule=o.schedule, lr=o.lr, **shape))


def param_groups(model: nn.Module, weight_decay: float, exclude: set[int] = frozenset(), *,
                 embedding_lr: float | None = None, head_lr: float | None = None) -> list[dict]:
    """AdamW groups: weight decay on ``nn.Linear`` weight matrices only (by module type, so FSDP's
    flattened shards too); biases, norms, embeddings and the LM head, tied or not, get none.
    ``exclude``: ids of parameters another optimizer steps. ``embedding_lr`` / ``head_lr``: the
    embeddings and an untied head in groups of their own at that peak lr (None: in the no-decay
    group, so older checkpoints' two groups still load)."""
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


def _misfit(found: object) -> str | None:
    if isinstance(found, type) and issubclass(found, torch.optim.Optimizer):
        return None
    return "not a torch.optim.Optimizer subclass"


# OPTIMIZERS[key].load(path): the optimizer class a dotted path names for optim.<key>; a path
# that names none is one line naming the key and the fix.
OPTIMIZERS = {key: extension_point(
    f"optim.{key}", "an optimizer class", _misfit, "give the dotted path of a "
    "torch.optim.Optimizer subclass importable from the working directory, e.g. torch.optim.SGD "
    "or mypackage.optim.MyOptimizer") for key in ("optimizer", "matrix_optimizer")}


def _built(key: str, path: str, cls: type, params, lr: float, kwargs: dict):
    """``cls(params, lr=lr, **kwargs)``: its failure is one line naming ``optim.<key>``."""
    given = ", ".join(kwargs) or "nothing else"
    fix = (f"check that {cls.__name__} takes minigpt's parameter groups and these arguments "
           f"(optim.{KWARGS[key]}), or choose another class")
    with OPTIMIZERS[key].first_use(path, f"when built with lr and {given}", fix=fix):
        return cls(params, lr=lr, **kwargs)


KWARGS = {"optimizer": "optimizer_kwargs", "matrix_optimizer": "matrix_kwargs"}


def checkpoint_name(cls: type) -> str:
    """The checkpoint key of an optimizer's state: ``optimizer`` for AdamW, else its class name
    in lower case (``muon``), so resuming with another optimizer class is refused by name."""
    return "optimizer" if cls is torch.optim.AdamW else cls.__name__.lower()


def _accepted(cls: type, settings: dict) -> dict:
    """The ``settings`` that ``cls``'s constructor names as parameters: minigpt's AdamW and
    Muon settings (betas, eps, momentum, ...) reach any class that takes them, and no other."""
    parameters = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in settings.items() if k in parameters}


def main_optimizer(model: nn.Module, optim: OptimSchema, *, fused: bool,
                   exclude: set[int] = frozenset()) -> torch.optim.Optimizer:
    """``optim.optimizer`` (AdamW by default) over ``param_groups`` at ``optim.lr``, with
    ``beta1``/``beta2``/``eps`` where the class takes them, ``optim.optimizer_kwargs`` last, and
    ``fused`` (one kernel per group) where the caller allows it."""
    cls = OPTIMIZERS["optimizer"].load(optim.optimizer)
    settings = _accepted(cls, {"betas": (optim.beta1, optim.beta2), "eps": optim.eps,
                               **({"fused": True} if fused else {})})
    groups = param_groups(model, optim.weight_decay, exclude, embedding_lr=optim.embedding_lr,
                          head_lr=optim.head_lr)
    return _built("optimizer", optim.optimizer, cls, groups, optim.lr,
                  {**settings, **optim.optimizer_kwargs})


def matrix_optimizer(model: nn.Module, optim: OptimSchema) -> torch.optim.Optimizer:
    """``optim.matrix_optimizer`` (``optim=muon``: ``torch.optim.Muon``) over
    ``block_matrices`` at ``optim.muon_lr``, with ``muon_weight_decay``, ``muon_momentum``,
    Nesterov and ``muon_adjust_lr`` where the class takes them, ``optim.matrix_kwargs`` last.
    ``muon_split_qkv``: queries, keys and values as three matrices (``QKVViews``)."""
    cls = OPTIMIZERS["matrix_optimizer"].load(optim.matrix_optimizer)
    settings = _accepted(cls, {"weight_decay": optim.muon_weight_decay,
                               "momentum": optim.muon_momentum, "nesterov": True,
                               "adjust_lr_fn": optim.muon_adjust_lr})
    splits = QKVViews(model) if optim.muon_split_qkv else None
    matrices = block_matrices(model)
    optimizer = _built("matrix_optimizer", optim.matrix_optimizer, cls,
                       splits.replace(matrices) if splits else matrices, optim.muon_lr,
                       {**settings, **optim.matrix_kwargs})
    if splits:
        splits.attach(optimizer)
    return optimizer


def build_optimizers(model: nn.Module, optim: OptimSchema | dict, *, fused: bool) -> dict:
    """The run's optimizers by their ``checkpoint_name``: ``main_optimizer`` for the whole
    model, or, with ``optim.matrix_optimizer`` set, ``matrix_optimizer`` for the blocks'
    matrices and ``main_optimizer`` for the rest (``{"optimizer": AdamW, "muon": Muon}``)."""
    optim = as_optim(optim)
    if optim.matrix_optimizer is None:
        main = main_optimizer(model, optim, fused=fused)
        return {checkpoint_name(type(main)): main}
    matrices = matrix_optimizer(model, optim)
    rest = main_optimizer(model, optim, fused=fused,
                          exclude={id(p) for p in block_matrices(model)})
    names = [checkpoint_name(type(rest)), checkpoint_name(type(matrices))]
    if names[0] == names[1]:  # one class for both: the matrices' gets a name of its own
        names[1] = f"matrix_{names[1]}"
    return dict(zip(names, (rest, matrices), strict=True))


def check_optimizers_run(optim: OptimSchema, strategy: str, precision: str) -> None:
    """Before any work: each optimizer class imports, and a matrix optimizer is not asked to
    run where it cannot. One-line errors naming the way out."""
    OPTIMIZERS["optimizer"].load(optim.optimizer)
    if optim.matrix_optimizer is None:
        return
    OPTIMIZERS["matrix_optimizer"].load(optim.matrix_optimizer)
    chosen = f"optim.matrix_optimizer={optim.matrix_optimizer} (optim={optim.name})"
    if strategy == "fsdp":
        raise ConfigError(f"{chosen} does not run under trainer=fsdp (FSDP hands the optimizer "
                          "flattened shards, not the block matrices); use trainer=ddp, or "
                          "optim=adamw with FSDP")
    if precision.startswith("16"):
        raise ConfigError(f"{chosen} does not run with trainer.precision={precision} (one "
                          "gradient scaler for two optimizers); use bf16-mixed or 32-true")


# ---- Muon on q, k and v one at a time (optim.muon_split_qkv) ----------------------------------

class QKVViews:
    """The query, key and value rows of every fused ``qkv.weight`` in ``model`` as three
    parameters each: views sharing the weight's storage, so Muon's in-place updates land in the
    model (its state dict and checkpoints do not change). ``attach(optimizer)``: before each step
    the views get their slices of the fused gradients; after it the fused gradients are dropped,
    as no other optimizer owns those weights to zero them."""

    def __init__(self, model: nn.Module):
        self.splits = []  # (fused weight, its row slices, a view of each)
        for attention in (m for m in model.modules() if isinstance(m, MultiHeadAttention)):
            weight, kv = attention.qkv.weight, attention.num_kv_heads * attention.head_dim
            bounds = [0, attention.d_out, attention.d_out + kv, attention.d_out + 2 * kv]
            rows = [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
            # detach() shares the storage: Muon's in-place updates of a view update the weight
            self.splits.append((weight, rows, [nn.Parameter(weight.detach()[r]) for r in rows]))

    def replace(self, matrices: list[nn.Parameter]) -> list[nn.Parameter]:
        """``matrices`` in order, each fused qkv weight replaced by its three views."""
        views = {id(weight): views for weight, _, views in self.splits}
        return [v for p in matrices for v in views.get(id(p), [p])]

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.register_step_pre_hook(self._share_grads)
        optimizer.register_step_post_hook(self._drop_grads)

    def _share_grads(self, *_) -> None:
        for weight, rows, views in self.splits:
            for view, r in zip(views, rows, strict=True):
                view.grad = None if weight.grad is None else weight.grad[r]

    def _drop_grads(self, *_) -> None:
        for weight, _, views in self.splits:
            weight.grad = None
            for view in views:
                view.grad = None
