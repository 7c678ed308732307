"""Scoring a checkpoint on benchmarks: evaluation tasks (``minigpt.eval.task``, one class each;
a user's own by its dotted path), in training and from the command line, and lm-evaluation-harness
(``minigpt.eval.harness``, the ``eval`` extra, not imported here: a training run needs no lm_eval).
Commands: ``python -m minigpt.eval task=hellaswag ...`` or ``... harness tasks=...``.
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
from minigpt.eval.scoring import Score, fit_row, score_groups, score_pairs, score_rows
from minigpt.eval.task import Task, evaluate
from minigpt.eval.training import TASKS, task_class, tasks_in_training, training_items

__all__ = ["TASKS", "HellaSwag", "HellaSwagError", "Item", "Result", "Score", "Task", "evaluate",
           "fit_row", "load_items", "read_items", "score_groups", "score_items", "score_pairs",
           "score_rows", "task_class", "tasks_in_training", "training_items"]
