"""The evaluation tasks by name (``TASKS``, or a user's ``Task`` subclass by its dotted path),
and inside a training run, from the ``eval:`` block of ``configs/train.yaml``: the run loads each
task's items once (``training_items``) and every ``eval.every`` validations the loop logs
``tasks_in_training(...)`` (``eval/<task>/<metric>``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minigpt.dotted import extension_point
from minigpt.errors import UserError
from minigpt.eval.chat import ChatTask
from minigpt.eval.hellaswag import HellaSwag
from minigpt.eval.task import Task, evaluate
from minigpt.field_rules import Satisfies

if TYPE_CHECKING:
    from minigpt.config import EvalSchema

EVAL_CACHE = "eval"  # under data_root: where a task's default items are downloaded once

TASKS: dict[str, type[Task]] = {"hellaswag": HellaSwag, "chat": ChatTask}
# The evaluation command's rule for ``task`` (``minigpt.config.rules.settings_problems``).
TASK_RULE = Satisfies(lambda t: t in ("harness", *TASKS)
                      or isinstance(t, str) and "." in t.strip("."),
                      f"one of {', '.join(TASKS)}, harness, or the dotted path of a "
                      "minigpt.eval.task.Task subclass")


def _misfit(found: object) -> str | None:
    if not (isinstance(found, type) and issubclass(found, Task)):
        return "not a minigpt.eval.task.Task subclass"
    missing = [name for name in ("items", "requests", "item_metrics")
               if getattr(found, name) is getattr(Task, name)]
    return f"a Task subclass without {', '.join(missing)} of its own" if missing else None


TASK = extension_point("task", "an evaluation task", _misfit,
                       f"use {', '.join(TASKS)}, or the dotted path of a minigpt.eval.task.Task "
                       "subclass importable from the working directory")


def task_class(name: str, key: str = "task") -> type[Task]:
    """The ``Task`` class ``name`` names: a built-in one, or a user's subclass that defines
    ``items``, ``requests`` and ``item_metrics``; anything else is one line naming ``key``."""
    if name in TASKS:
        return TASKS[name]
    return TASK.load(name, key)


def training_items(eval_cfg: EvalSchema, data_root, chat_template=None
                   ) -> list[tuple[Task, Sequence[Any]]] | None:
    """Each task of ``eval.tasks`` with its first ``eval.limit`` items (of ``eval.path`` or the
    default set, downloaded once into ``<data_root>/eval``), or ``None`` with ``every: 0``.
    ``chat_template``: the run's, for the tasks that score conversations."""
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
    """The tasks ``eval.tasks`` names (none with ``every: 0``), items not read yet: a bad name
    fails before a run does any work."""
    if not eval_cfg.every:
        return []
    return [task_class(name, "eval.tasks")(eval_cfg.path, Path(data_root) / EVAL_CACHE)
            for name in eval_cfg.tasks]


def tasks_in_training(model, tokenizer, tasks: Sequence[tuple[Task, Sequence[Any]]], device,
                      batch_size: int = 16,
                      autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                      through_forward: bool = False) -> dict[str, float]:
    """``{"eval/<task>/<metric>": value}`` for each task's items (``training_items``).

    ``model``: the plain module being trained (the scorer calls ``hidden_states`` and ``logits``,
    which Fabric's DDP wrapper refuses), back in training mode afterwards; ``autocast``: e.g.
    ``fabric.autocast``. Under FSDP, whose weights gather only inside ``forward``, pass the
    Fabric-wrapped model and ``through_forward=True``. Every rank computes the same numbers.
    """
    metrics = {}
    for task, items in tasks:
        result = evaluate(task, model, tokenizer, items, batch_size=batch_size, device=device,
                          autocast=autocast, through_forward=through_forward)
        metrics.update({f"eval/{task.name}/{m}": result[m] for m in task.metrics
                        if result[m] is not None})  # None: no item of the task measures it
    return metrics
