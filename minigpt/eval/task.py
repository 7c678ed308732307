"""An evaluation task is one class (``Task``): its items, the continuations each item asks the
model to score (and, if it needs them, the model's greedy replies), each item's metrics, and the
metrics' names. ``evaluate`` runs any task, from ``python -m minigpt.eval task=...`` and in
training (``eval.tasks``); a task of one's own is named by its dotted path (docs/extending.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from minigpt.errors import UserError
from minigpt.eval.scoring import Score, score_pairs


class Task:
    """A task scored by the log-likelihood of continuations (multiple choice, cloze).

    ``name``: the metrics are logged as ``eval/<name>/<metric>`` (default: the class name in
    lower case); ``metrics``: the names of ``item_metrics``' values that are averaged over the
    items. ``path`` (``eval.path`` / ``path=``): a file of items, if the task reads one; null:
    its own default, downloaded into ``cache_dir`` if it needs to be.

    A task that reads conversations sets ``uses_chat_template``; the command then gives it the
    model's template as ``chat_template`` (``minigpt.chat.template``) before ``evaluate``."""

    name: str = ""
    metrics: tuple[str, ...] = ()
    uses_chat_template: bool = False
    chat_template = None

    def __init__(self, path: str | None = None, cache_dir: str | Path = "data/eval"):
        self.path, self.cache_dir = path, cache_dir
        self.name = self.name or type(self).__name__.lower()

    def items(self, limit: int | None = None) -> Sequence[Any]:
        """The first ``limit`` items (all with None); a bad file is a one-line error."""
        raise NotImplementedError

    def check_tokenizer(self, tokenizer) -> None:
        """A one-line ``UserError`` if the task cannot be scored in ``tokenizer``'s tokens
        (``evaluate`` asks first); the default takes any."""

    def requests(self, item, tokenizer) -> list[tuple[list[int], list[int]]]:
        """The ``(context, continuation)`` token ids whose log-likelihood ``item`` needs."""
        raise NotImplementedError

    def replies(self, model, items: Sequence[Any], *, device="cpu",
                autocast: Callable[[], contextlib.AbstractContextManager] | None = None
                ) -> list[Any] | None:
        """What the model generates for each item, handed to ``item_metrics`` as ``reply``;
        None (the default): the task only scores continuations."""
        return None

    def item_metrics(self, item, scores: Sequence[Score], reply: Any = None) -> dict[str, Any]:
        """``item``'s metrics from its requests' ``Score``s (in request order) and its
        ``reply`` (``replies``); the values named in ``metrics`` are averaged over the items
        that have them (None: not measured on this item), any other is kept for ``summary``."""
        raise NotImplementedError

    def summary(self, per_item: list[dict]) -> dict:
        """Extra keys of the command's result (JSON), from every item's ``item_metrics``."""
        return {}


def evaluate(task: Task, model, tokenizer, items: Sequence[Any], *, batch_size: int = 16,
             device="cpu", autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
             progress: bool = False, through_forward: bool = False) -> dict:
    """``{"task", <each metric>, "n", "truncated", **task.summary}`` of ``model`` on ``items``.
    Every request of every item is scored by ``score_pairs`` (a context shared by several
    continuations runs once), ``batch_size`` items per forward pass; ``truncated``: items with
    a request cut from the left to fit the model. See ``score_rows`` for ``autocast`` and
    ``through_forward``; ``progress`` shows a bar on stderr."""
    task.check_tokenizer(tokenizer)
    pairs, spans = [], []  # spans: (first request, count) of each item
    for i, item in enumerate(items):
        requests = task.requests(item, tokenizer)
        for j, (context, continuation) in enumerate(requests):
            if not len(context) or not len(continuation):
                empty = "context" if not len(context) else "continuation"
                raise UserError(f"{task.name}: item {i} (request {j}) has an empty {empty} "
                                "after tokenizing: a continuation of at least one token is "
                                "scored after a context of at least one; fix the item")
        spans.append((len(pairs), len(requests)))
        pairs += requests
    with tqdm(total=len(pairs), desc=f"{task.name} requests", unit="request",
              disable=not progress) as bar:
        scores, cut = score_pairs(model, pairs, device=device, autocast=autocast,
                                  batch_size=batch_size * max([n for _, n in spans] + [1]),
                                  progress=bar.update, through_forward=through_forward)
    replies = task.replies(model, items, device=device, autocast=autocast)
    per_item = [task.item_metrics(item, scores[start:start + n]) if replies is None else
                task.item_metrics(item, scores[start:start + n], replies[i])
                for i, (item, (start, n)) in enumerate(zip(items, spans, strict=True))]
    # each metric's mean over the items that measure it (None where none does)
    measured = {m: [r[m] for r in per_item if r.get(m) is not None] for m in task.metrics}
    return {"task": task.name, **{m: sum(v) / len(v) if v else None for m, v in measured.items()},
            "n": len(per_item), "truncated": sum(any(cut[s:s + k]) for s, k in spans),
            **task.summary(per_item)}
