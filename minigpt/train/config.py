"""Checks of the composed training config, all at once, before any work starts."""

from __future__ import annotations

import os

import torch
from omegaconf import DictConfig, OmegaConf

from minigpt.errors import ConfigError
from minigpt.eval.training import config_problems
from minigpt.model import GPTConfig
from minigpt.train.plan import batch_plan

MODEL_EXTRA_KEYS = ("name", "init_from")  # model/*.yaml keys that are not GPTConfig fields

__all__ = ["ConfigError", "check_config", "gpt_config"]  # ConfigError: its home is minigpt.errors


def check_config(cfg: DictConfig) -> None:
    """Every user-facing value that can be wrong, checked at once before training."""
    problems = []
    o, t = cfg.optim, cfg.trainer
    for key in ("lr", "min_lr", "weight_decay", "eps", "grad_clip"):
        value = o.get(key)
        if value is not None and (not isinstance(value, (int, float)) or value < 0):
            problems.append(f"optim.{key}={value!r} must be a number >= 0")
    if cfg.get("cpu_speedups", "auto") not in ("auto", False):
        problems.append(f"cpu_speedups={cfg.get('cpu_speedups')!r} must be auto or false")
    threads = cfg.get("threads")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        problems.append(f"threads={threads!r} must be null or a positive integer")
    if isinstance(o.get("lr"), (int, float)) and o.lr == 0:
        problems.append("optim.lr=0 would not train; use a positive learning rate")
    if isinstance(o.get("min_lr"), (int, float)) and isinstance(o.get("lr"), (int, float)) \
            and o.lr > 0 and o.min_lr > o.lr:
        problems.append(f"optim.min_lr={o.min_lr} must not exceed optim.lr={o.lr}")
    if o.get("schedule", "cosine") not in ("cosine", "wsd"):
        problems.append(f"optim.schedule={o.get('schedule')!r} must be cosine or wsd")
    fraction = o.get("cooldown_fraction", 0.45)
    if not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        problems.append(f"optim.cooldown_fraction={fraction!r} must be in (0, 1]")
    if o.get("name", "adamw") not in ("adamw", "muon"):
        problems.append(f"optim.name={o.get('name')!r} must be adamw or muon (optim=adamw|muon)")
    for key in ("muon_lr", "muon_momentum", "muon_weight_decay"):
        value = o.get(key)
        if o.get("name") == "muon" and (not isinstance(value, (int, float)) or value < 0):
            problems.append(f"optim.{key}={value!r} must be a number >= 0")
    for key in ("embedding_lr", "head_lr"):
        value = o.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or value <= 0):
            problems.append(f"optim.{key}={value!r} must be null (optim.lr) or a number > 0")
    if o.get("head_lr") is not None and cfg.model.get("tie_head", True):
        problems.append(f"optim.head_lr={o.head_lr} needs model.tie_head=false (a tied head is "
                        "the token embedding): set optim.head_lr=null, and optim.embedding_lr "
                        "for both")
    target = t.get("target_val_loss")
    if target is not None and (not isinstance(target, (int, float)) or target <= 0):
        problems.append(f"trainer.target_val_loss={target!r} must be null or a loss > 0")
    for key in ("beta1", "beta2"):
        if not 0 <= o.get(key, 0.9) < 1:
            problems.append(f"optim.{key}={o.get(key)} must be in [0, 1)")
    for key in ("warmup_steps", "decay_steps"):
        if not isinstance(o.get(key), int) or o.get(key) < 0:
            problems.append(f"optim.{key}={o.get(key)!r} must be an integer >= 0")
    for key in ("max_steps", "val_check_interval", "log_every_n_steps"):
        value = t.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"trainer.{key}={value!r} must be a positive integer (optimizer steps)")
    limit = t.get("limit_val_batches")
    if limit is not None and not (isinstance(limit, int) and limit >= 1 or
                                  isinstance(limit, float) and 0 < limit <= 1):
        problems.append(f"trainer.limit_val_batches={limit!r} must be null, a number of batches "
                        ">= 1, or a fraction in (0, 1]")
    accumulate = t.get("accumulate_grad_batches", 1)
    if not isinstance(accumulate, int) or accumulate < 1:
        problems.append(f"trainer.accumulate_grad_batches={accumulate!r} must be a positive integer")
    if cfg.get("compile", "auto") not in ("auto", True, False):
        problems.append(f"compile={cfg.get('compile')!r} must be auto, true or false")
    for key in ("batch_size", "num_workers", "val_tokens", "tokens_per_step"):
        value, low = cfg.data.get(key), 0 if key == "num_workers" else 1  # null: not set
        if value is not None and (not isinstance(value, int) or value < low):
            problems.append(f"data.{key}={value!r} must be an integer >= {low}")
    problems += config_problems(cfg.eval) if "eval" in cfg else []
    problems += _machine_problems(t) or _device_problems(t)
    problems += _batch_problems(cfg)
    model = OmegaConf.to_container(cfg.model, resolve=True)
    try:
        gpt_config(model, model.get("vocab_size") or 64)  # any valid size: the real one comes from the data
    except ValueError as e:
        problems.append(f"model: {e}")
    if problems:
        raise ConfigError("bad config: " + "; ".join(problems))


def _batch_problems(cfg: DictConfig) -> list[str]:
    """``data.tokens_per_step`` against the batch plan, when the number of processes is given as
    numbers (with ``devices: auto`` the trainer knows it, and ``build_trainer`` checks then)."""
    tokens, t = cfg.data.get("tokens_per_step"), cfg.trainer
    devices, nodes = t.get("devices", "auto"), t.get("num_nodes", 1)
    numbers = (cfg.data.get("batch_size"), cfg.model.get("context_length"), devices, nodes)
    if tokens is None or not all(isinstance(n, int) and n > 0 for n in numbers) \
            or not isinstance(tokens, int) or tokens < 1:
        return []
    try:
        batch_plan(tokens, t.get("accumulate_grad_batches", 1), cfg.data.batch_size,
                   cfg.model.context_length, devices * nodes)
    except ConfigError as e:
        return [str(e)]
    return []


def _machine_problems(t: DictConfig) -> list[str]:
    """Settings this machine cannot run, named with what it offers."""
    accelerator = t.get("accelerator", "auto")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    offers = f"{gpus} GPU(s)" if gpus else "no GPU (CUDA is not available), only the CPU"
    if accelerator in ("gpu", "cuda") and not gpus:
        return [f"trainer.accelerator={accelerator} but this machine has {offers}; use "
                "trainer.accelerator=cpu or auto"]
    return []


def _device_problems(t: DictConfig) -> list[str]:
    accelerator, devices = t.get("accelerator", "auto"), t.get("devices", "auto")
    if devices in ("auto", -1, "-1", None) or isinstance(devices, str):
        return []
    count = len(devices) if OmegaConf.is_list(devices) else devices
    if not isinstance(count, int) or count < 1:
        return [f"trainer.devices={devices!r} must be a positive integer, a list of ids, or auto"]
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        have, what = torch.cuda.device_count(), "GPU(s)"
    else:
        have, what = os.cpu_count() or 1, "CPU core(s) (one process each)"
    if count > have:
        return [f"trainer.devices={devices} but this machine has {have} {what}"]
    return []


def gpt_config(model_cfg: dict, vocab_size: int) -> GPTConfig:
    fields = {k: v for k, v in model_cfg.items() if k not in MODEL_EXTRA_KEYS}
    fields["vocab_size"] = vocab_size
    return GPTConfig.from_dict(fields)
