"""HellaSwag inside a training run: what the loop calls, given the ``eval:`` block of
``configs/train.yaml`` (``every``, ``limit``, ``path``, ``batch_size``).

Its values are checked with the rest of the run's config (``minigpt.config.rules``); the loop
loads the items once with ``training_items`` (``None`` when off), and every ``eval.every`` validations logs
``hellaswag_in_training(...)`` to its loggers and ``summary.json``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from minigpt.eval.hellaswag import Item, load_items, score_items

if TYPE_CHECKING:
    from minigpt.config import EvalSchema

EVAL_CACHE = "eval"  # under data_root: where the validation set is downloaded once


def training_items(eval_cfg: EvalSchema, data_root) -> list[Item] | None:
    """The items the run scores (the first ``eval.limit`` of ``eval.path``, or of the
    validation set downloaded once into ``<data_root>/eval``), or ``None`` with ``every: 0``."""
    if not eval_cfg.every:
        return None
    return load_items(eval_cfg.path, eval_cfg.limit, Path(data_root) / EVAL_CACHE)


def hellaswag_in_training(model, tokenizer, items: Sequence[Item], device, batch_size: int = 16,
                          autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                          through_forward: bool = False) -> dict[str, float]:
    """The metrics the loop logs at a validation: ``{"eval/hellaswag_acc": ...,
    "eval/hellaswag_acc_norm": ...}`` for ``items`` (``training_items``, loaded once).

    ``model``: the ``GPT`` being trained, back in its training mode afterwards; ``autocast``:
    e.g. ``fabric.autocast``. By default the scorer calls ``model.hidden_states`` and
    ``model.logits`` (the head only where an ending is scored): pass the plain module
    (``fabric_model.module``; Fabric refuses calls of methods other than ``forward`` on its DDP
    wrapper, and the plain module holds the same weights). With FSDP, whose weights gather only
    inside ``forward``, pass the Fabric-wrapped model and ``through_forward=True`` (every
    position's logits: slower). Every rank computes the same numbers from the same items.
    """
    result = score_items(model, tokenizer, items, batch_size=batch_size, device=device,
                         autocast=autocast, through_forward=through_forward)
    return {"eval/hellaswag_acc": result.acc, "eval/hellaswag_acc_norm": result.acc_norm}
