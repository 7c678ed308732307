"""What ``python -m minigpt.eval`` runs: load a model, score it, print a table, write JSON.

Results go to stdout (the table) and ``out``; progress and diagnostics to stderr.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from omegaconf import DictConfig

from minigpt.chat.cli import chat_template_of
from minigpt.config import EvalCommandSchema, settings_problems, typed
from minigpt.devices import check_device
from minigpt.errors import UserError
from minigpt.eval.task import evaluate
from minigpt.eval.training import TASK_RULE, task_class
from minigpt.files import atomic_write
from minigpt.paths import check_paths


def run(cfg: EvalCommandSchema | DictConfig, out=None) -> dict:
    """Score the model ``cfg`` names on ``cfg.task`` (one of ``TASKS``, or ``harness``); print
    the table to ``out`` (stdout), write ``cfg.out``; return what was written."""
    out = out or sys.stdout
    cfg = typed(cfg, EvalCommandSchema)
    _check_options(cfg)
    tasks = _task_list(cfg.tasks) if cfg.task == "harness" else None  # none given: say so first
    check_paths(cfg)  # path, out, include_path, ...: before any item is scored
    check_device(cfg.device)  # before the items and the model are read
    result = _run_task(cfg, out) if tasks is None else _run_harness(cfg, tasks, out)
    out.flush()
    if cfg.out is not None:  # checked by check_paths before any work
        text = json.dumps(result, indent=1, default=str) + "\n"
        atomic_write(Path(cfg.out), lambda tmp: tmp.write_text(text, encoding="utf-8"))
        print(f"wrote {cfg.out}", file=sys.stderr, flush=True)
    return result


def _run_task(cfg: EvalCommandSchema, out) -> dict:
    task = task_class(cfg.task)(cfg.path, cfg.cache_dir)
    items = task.items(cfg.limit)  # before the model: a bad file fails at once
    loaded, autocast = _load(cfg)
    if task.uses_chat_template:
        task.chat_template = chat_template_of(loaded, cfg.chat_template)
    result = {"source": loaded.source, **evaluate(
        task, loaded.model, loaded.tokenizer, items, batch_size=cfg.batch_size,
        device=loaded.device, autocast=autocast, progress=cfg.progress)}
    out.write(task_table(result, task.metrics) + "\n")
    return result


def _run_harness(cfg: EvalCommandSchema, tasks: list[str], out) -> dict:
    from minigpt.eval.harness import MiniGPTLM, run_harness  # fails here without lm_eval

    loaded, autocast = _load(cfg)
    template = chat_template_of(loaded, cfg.chat_template) if cfg.apply_chat_template else None
    lm = MiniGPTLM(loaded.model, loaded.tokenizer, batch_size=cfg.batch_size,
                   device=loaded.device, autocast=autocast, max_gen_toks=cfg.max_gen_toks,
                   chat_template=template)
    results = run_harness(lm, tasks, num_fewshot=cfg.num_fewshot, limit=cfg.limit,
                          include_path=cfg.include_path,
                          apply_chat_template=cfg.apply_chat_template)
    from lm_eval.utils import make_table

    out.write(make_table(results) + "\n")
    return {"source": loaded.source, **{k: results[k] for k in ("results", "versions", "n-shot",
                                                                  "config") if k in results}}


def task_table(result: dict, metrics) -> str:
    """A two-line table of a task's result: its name, item count, metrics, truncated items."""
    name_width = max(10, len(result["task"]) + 1)
    widths = {m: max(7, len(m) + 1) for m in metrics}
    head = "".join(f" {m:>{w}}" for m, w in widths.items())
    values = "".join(f" {result[m]:>{w}.4f}" if result[m] is not None else f" {'-':>{w}}"
                     for m, w in widths.items())
    return (f"{'task':<{name_width}} {'n':>6}{head} {'truncated':>10}\n"
            f"{result['task']:<{name_width}} {result['n']:>6}{values} {result['truncated']:>10}")


def _load(cfg: DictConfig):
    """``(loaded, autocast)``: float32 weights on the device, and the autocast that computes in
    ``cfg.dtype`` (``None``: float32), as training's evaluation does."""
    from minigpt.inference import load_for_scoring  # looked up here: tests replace it

    loaded = load_for_scoring(cfg.ckpt_path, cfg.pretrained, cfg.checkpoints_root,
                              device=cfg.device, dtype=cfg.dtype)
    print(loaded.describe(), file=sys.stderr, flush=True)
    return loaded, loaded.scoring_autocast()


def _task_list(tasks) -> list[str]:
    """Task names from ``tasks=a,b`` (a string) or ``tasks=[a,b]`` (a list)."""
    names = tasks.split(",") if isinstance(tasks, str) else list(tasks or [])
    names = [str(n).strip() for n in names if str(n).strip()]
    if not names:
        raise UserError("harness needs tasks: python -m minigpt.eval harness "
                        "tasks=lambada_openai,arc_easy (`lm_eval ls tasks` lists them)")
    return names


def _check_options(cfg: EvalCommandSchema) -> None:
    """Every bad value at once: the schema's types and rules, then the rules across fields."""
    problems = settings_problems(cfg, {"task": TASK_RULE})
    if cfg.task != "harness" and cfg.tasks is not None:
        problems.append("tasks= is for the harness: python -m minigpt.eval harness tasks=...")
    if cfg.task != "harness" and cfg.apply_chat_template:
        problems.append("apply_chat_template=true is for the harness (task=chat always uses "
                        "the template): drop it")
    if problems:
        raise UserError("; ".join(problems))
