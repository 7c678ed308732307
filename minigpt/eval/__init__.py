"""Scoring a checkpoint on benchmarks: evaluation tasks (``minigpt.eval.task``: one class each;
HellaSwag completion-style, ``minigpt.eval.hellaswag``; a user's own by its dotted path),
during training and from the command line, and every other benchmark through
lm-evaluation-harness (``minigpt.eval.harness``, an optional extra: ``pip install -e '.[eval]'``).

``python -m minigpt.eval task=hellaswag ...`` and ``python -m minigpt.eval harness tasks=...``
are the commands (``configs/eval.yaml``). The harness module is not imported here: it needs
``lm_eval``, which a training run does not.
"""

from minigpt.eval.hellaswag import (
    HellaSwag,
    HellaSwagError,
    Item,
    Result,
    load_items,
    read_items,
    score_items,
)
from minigpt.eval.registry import TASKS, task_class
from minigpt.eval.scoring import Score, fit_row, score_groups, score_pairs, score_rows
from minigpt.eval.task import Task, evaluate
from minigpt.eval.training import tasks_in_training, training_items

__all__ = [
    "TASKS",
    "HellaSwag",
    "HellaSwagError",
    "Item",
    "Result",
    "Score",
    "fit_row",
    "evaluate",
    "load_items",
    "read_items",
    "score_items",
    "score_groups",
    "score_pairs",
    "score_rows",
    "Task",
    "task_class",
    "tasks_in_training",
    "training_items",
]
