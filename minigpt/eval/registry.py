"""The evaluation tasks by name: the built-in ones, or a user's ``Task`` subclass by its dotted
path (``minigpt.dotted``), so a task of one's own needs no edit here."""

from __future__ import annotations

from minigpt.dotted import extension_point
from minigpt.eval.chat import ChatTask
from minigpt.eval.hellaswag import HellaSwag
from minigpt.eval.task import Task
from minigpt.field_rules import Satisfies

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
