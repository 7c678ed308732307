"""A user's own module: an optimizer, a data source and an evaluation task, written outside
``minigpt/`` and named by dotted path from the command line (``tests/test_extending.py``;
``docs/extending.md`` walks through each)."""

from __future__ import annotations

import torch

from minigpt.eval.task import Task


class MyOptimizer(torch.optim.Optimizer):
    """Heavy-ball SGD with decoupled weight decay: ``v = momentum * v + grad``,
    ``p -= lr * (v + weight_decay * p)``. Its state (``velocity``) must survive a resume."""

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.9, weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "velocity" not in state:
                    state["velocity"] = torch.zeros_like(p)
                velocity = state["velocity"].mul_(group["momentum"]).add_(p.grad)
                p.add_(velocity + group["weight_decay"] * p, alpha=-group["lr"])


def counting_rhymes(count: int = 50, animal: str = "sheep"):
    """A data source: ``count`` documents of plain text, yielded one at a time
    (``data.source=tests.extending_module.counting_rhymes``, ``+data.source_args.count=...``)."""
    for i in range(count):
        yield f"{i + 1} {animal} jumped over the fence, and the farmer counted {i + 1}.\n" * 3


class NextWord(Task):
    """An evaluation task on the rhymes above: what follows ``N goat jumped over the fence``?
    ``acc``: the right continuation (``,``) has the highest log-probability of the three;
    ``right_logprob``: its log-probability."""

    name = "next_word"
    metrics = ("acc", "right_logprob")

    def items(self, limit=None):
        items = [(f"{i} goat jumped over the fence", (",", ".", " and"), 0) for i in range(1, 9)]
        return items[:limit]

    def requests(self, item, tokenizer):
        context, choices, _ = item
        return [(tokenizer.encode(context), tokenizer.encode(choice)) for choice in choices]

    def item_metrics(self, item, scores):
        best = max(range(len(scores)), key=lambda k: scores[k].logprob)
        return {"acc": float(best == item[2]), "right_logprob": scores[item[2]].logprob}
