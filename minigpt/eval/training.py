"""Evaluation tasks inside a training run: what the loop calls, given the ``eval:`` block of
``configs/train.yaml`` (``tasks``, ``every``, ``limit``, ``path``, ``batch_size``).

Its values are checked with the rest of the run's config (``minigpt.config.rules``); the run
loads each task's items once with ``training_items`` (``None`` when off), and every
``eval.every`` validations the loop logs ``tasks_in_training(...)`` (``eval/<task>/<metric>``)
to its loggers and ``summary.json``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minigpt.errors import UserError
from minigpt.eval.registry import task_class
from minigpt.eval.task import Task, evaluate

if TYPE_CHECKING:
    from minigpt.config import EvalSchema

EVAL_CACHE = "eval"  # under data_root: where a task's default items are downloaded once


def training_items(eval_cfg: EvalSchema, data_root, chat_template=None
                   ) -> list[tuple[Task, Sequence[Any]]] | None:
    """Each task of ``eval.tasks`` with the items the run scores (the first ``eval.limit`` of
    ``eval.path``, or of the task's default set, downloaded once into ``<data_root>/eval``),
    or ``None`` with ``every: 0``. ``chat_template``: the run's (fine-tuning on conversations),
    given to the tasks that read conversations (``task=chat``)."""
    if not eval_cfg.every:
        return None
    tasks = training_tasks(eval_cfg, data_root)
    for task in tasks:
        if task.uses_chat_template:
            if chat_template is None:
                raise UserError(f"eval.tasks has {task.name!r}, which scores conversations "
                                "through the run's chat template: fine-tune with "
                                "experiment=sft (data=chat), or drop it from eval.tasks")
            task.chat_template = chat_template
    return [(task, task.items(eval_cfg.limit)) for task in tasks]


def training_tasks(eval_cfg: EvalSchema, data_root) -> list[Task]:
    """The tasks ``eval.tasks`` names (none with ``every: 0``), their items not read yet: a
    name that is not a task fails here, before a run does any work."""
    if not eval_cfg.every:
        return []
    return [task_class(name, "eval.tasks")(eval_cfg.path, Path(data_root) / EVAL_CACHE)
            for name in eval_cfg.tasks]


def tasks_in_training(model, tokenizer, tasks: Sequence[tuple[Task, Sequence[Any]]], device,
                      batch_size: int = 16,
                      autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                      through_forward: bool = False) -> dict[str, float]:
    """The metrics the loop logs at a validation, ``{"eval/<task>/<metric>": value}``, for each
    task's items (``training_items``, loaded once).

    ``model``: the ``GPT`` being trained, back in its training mode afterwards; ``autocast``:
    e.g. ``fabric.autocast``. By default the scorer calls ``model.hidden_states`` and
    ``model.logits`` (the head only where a continuation is scored): pass the plain module
    (``fabric_model.module``; Fabric refuses calls of methods other than ``forward`` on its DDP
    wrapper, and the plain module holds the same weights). With FSDP, whose weights gather only
    inside ``forward``, pass the Fabric-wrapped model and ``through_forward=True`` (every
    position's logits: slower). Every rank computes the same numbers from the same items.
    """
    metrics = {}
    for task, items in tasks:
        result = evaluate(task, model, tokenizer, items, batch_size=batch_size, device=device,
                          autocast=autocast, through_forward=through_forward)
        metrics.update({f"eval/{task.name}/{m}": result[m] for m in task.metrics
                        if result[m] is not None})  # None: no item of the task measures it
    return metrics
