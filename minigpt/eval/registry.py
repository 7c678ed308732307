"""The evaluation tasks by name: the built-in ones, or a user's ``Task`` subclass by its dotted
path (``minigpt.dotted``), so a task of one's own needs no edit here."""

from __future__ import annotations

from minigpt.dotted import named_object
from minigpt.errors import UserError
from minigpt.eval.chat import ChatTask
from minigpt.eval.hellaswag import HellaSwag
from minigpt.eval.task import Task
from minigpt.field_rules import Satisfies

TASKS: dict[str, type[Task]] = {"hellaswag": HellaSwag, "chat": ChatTask}
# The evaluation command's rule for ``task`` (``minigpt.config.rules.settings_problems``).
TASK_RULE = Satisfies(lambda t: t in ("harness", *TASKS) or isinstance(t, str) and "." in t.strip("."),
                      f"one of {', '.join(TASKS)}, harness, or the dotted path of a "
                      "minigpt.eval.task.Task subclass")


def task_class(name: str, key: str = "task") -> type[Task]:
    """The ``Task`` class ``name`` names; a name that does not is one line naming ``key``."""
    if name in TASKS:
        return TASKS[name]
    found, why = named_object(name, lambda c: isinstance(c, type) and issubclass(c, Task),
                              "not a minigpt.eval.task.Task subclass")
    if found is None:
        raise UserError(f"{key}={name!r} is not an evaluation task ({why}): use "
                        f"{', '.join(TASKS)}, or the dotted path of a minigpt.eval.task.Task "
                        "subclass importable from the working directory")
    return found
