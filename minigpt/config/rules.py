"""What a setting's value may be: one table of single-field rules per command (the types come
from the schemas' annotations) and the rules that span fields; ``typed(cfg, Schema)``, an entry
point's one conversion of a composed config into its schema's dataclass.
"""

from __future__ import annotations

import re
from typing import Any

from minigpt.config.reports import check_keys
from minigpt.config.schema import (
    ActivationCheckpointing,
    EvalCommandSchema,
    GenerateSchema,
    TrainSchema,
    VizSchema,
)
from minigpt.data.config import DATA_RULES, POSITIVE_INTEGER
from minigpt.devices import DTYPES
from minigpt.errors import ConfigError
from minigpt.field_rules import OneOf, Range, Rule, Satisfies, field_problems
from minigpt.model import GPT_CONFIG_RULES

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)
BUDGET_WORDS = "bytes (an integer) or a size such as 8GB, 12GiB, 512MB"


def parse_memory_budget(value) -> int | None:
    """``trainer.memory_budget`` in bytes: ``None`` (no budget), a positive integer of bytes, or
    a string such as ``"8GB"`` (10**9), ``"12GiB"`` (2**30), ``"1.5 TB"``. A ``ConfigError``
    naming the value otherwise."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = value, ""
    else:
        match = _SIZE.fullmatch(value) if isinstance(value, str) else None
        if match is None or match.group(2).lower() not in _UNITS:
            raise ConfigError(f"trainer.memory_budget={value!r} must be {BUDGET_WORDS}")
        number, unit = float(match.group(1)), match.group(2).lower()
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise ConfigError(f"trainer.memory_budget={value!r} must be {BUDGET_WORDS}, above 0")
    return size


def is_memory_budget(value) -> bool:
    """Whether ``parse_memory_budget`` takes ``value`` (the config rule)."""
    try:
        parse_memory_budget(value)
    except ConfigError:
        return False
    return True


POSITIVE = Range(0, low_open=True)
AT_LEAST_0, AT_LEAST_1 = Range(0), Range(1)
FRACTION = Range(0, 1, high_open=True)  # [0, 1)


def _count_or_fraction(value) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) and value >= 1 or isinstance(value, float) and 0 < value <= 1


def _under(prefix: str, rules: dict[str, Rule]) -> dict[str, Rule]:
    return {f"{prefix}.{key}": rule for key, rule in rules.items()}


CLASS_PATH = Satisfies(lambda v: v is None or isinstance(v, str) and "." in v.strip("."),
                       "a dotted class path such as torch.optim.SGD or mypackage.optim.MyOptimizer")
KEYWORDS = Satisfies(lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
                     "keyword arguments: +optim.<field>.<name>=<value>")
OPTIM_RULES = {
    "name": Satisfies(lambda n: isinstance(n, str) and bool(n), "a preset name such as adamw"),
    "optimizer": CLASS_PATH, "matrix_optimizer": CLASS_PATH,
    "optimizer_kwargs": KEYWORDS, "matrix_kwargs": KEYWORDS,
    "schedule": OneOf(("cosine", "wsd")),
    "cooldown_fraction": Range(0, 1, low_open=True),
    "lr": POSITIVE, "min_lr": AT_LEAST_0, "embedding_lr": POSITIVE, "head_lr": POSITIVE,
    "warmup_steps": AT_LEAST_0, "decay_steps": AT_LEAST_0, "weight_decay": AT_LEAST_0,
    "beta1": FRACTION, "beta2": FRACTION, "eps": AT_LEAST_0, "grad_clip": AT_LEAST_0,
    "muon_lr": POSITIVE, "muon_momentum": FRACTION, "muon_weight_decay": AT_LEAST_0,
    "muon_adjust_lr": OneOf(("original", "match_rms_adamw")),
}
TRAINER_RULES = {
    "num_nodes": AT_LEAST_1, "max_steps": AT_LEAST_1, "val_check_interval": AT_LEAST_1,
    "log_every_n_steps": AT_LEAST_1, "accumulate_grad_batches": AT_LEAST_1,
    "target_val_loss": POSITIVE,
    "limit_val_batches": Satisfies(lambda v: v is None or _count_or_fraction(v),
                                   "null, a number of batches >= 1, or a fraction in (0, 1]"),
    "fsdp.sharding_strategy": OneOf(("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD",
                                     "NO_SHARD")),
    "fsdp.state_dict_type": OneOf(("sharded", "full")),
    "memory_budget": Satisfies(lambda v: v is None or is_memory_budget(v), f"null, {BUDGET_WORDS}"),
    "activation_checkpointing": OneOf(tuple(ActivationCheckpointing)),
}
TRAIN_RULES: dict[str, Rule] = {
    **_under("model", GPT_CONFIG_RULES),
    **_under("data", DATA_RULES),
    "data.batch_size": Satisfies(lambda v: v == "auto" or POSITIVE_INTEGER.test(v),
                                 "a positive integer or auto (the largest that fits)"),
    **_under("optim", OPTIM_RULES),
    **_under("trainer", TRAINER_RULES),
    "logger.type": OneOf(("wandb", "csv", "none")),
    "logger.mode": OneOf(("online", "offline", "disabled")),
    "sample.max_new_tokens": AT_LEAST_0, "sample.temperature": AT_LEAST_0,
    "sample.top_k": AT_LEAST_1,
    "eval.tasks": Satisfies(lambda t: isinstance(t, list) and all(
        isinstance(n, str) and n for n in t), "a list of task names or dotted paths, e.g. "
        "[hellaswag]"),
    "eval.every": AT_LEAST_0, "eval.limit": AT_LEAST_1, "eval.batch_size": AT_LEAST_1,
    "compile": OneOf(("auto", True, False, "blocks")), "cpu_speedups": OneOf(("auto", False)),
    "threads": AT_LEAST_1, "peak_flops": POSITIVE,
}
GENERATE_RULES: dict[str, Rule] = {
    "max_new_tokens": AT_LEAST_0, "num_samples": AT_LEAST_1, "seed": AT_LEAST_0,
    "cpu_speedups": OneOf(("auto", False)), "dtype": OneOf(DTYPES),
    "decoder": OneOf(("auto", "eager", "compiled")),
    "chat_template": OneOf(("default",)),
}
EVAL_COMMAND_RULES: dict[str, Rule] = {  # task: minigpt.eval.training.TASK_RULE
    "dtype": OneOf(DTYPES),
    "batch_size": AT_LEAST_1, "max_gen_toks": AT_LEAST_1, "limit": AT_LEAST_1,
    "num_fewshot": AT_LEAST_0, "chat_template": OneOf(("default",)),
}
VIZ_RULES: dict[str, Rule] = {
    "command": OneOf(("attention", "runs")), "dtype": OneOf(DTYPES),
    "cpu_speedups": OneOf(("auto", False)),
    "layer": Satisfies(lambda v: v == "all" or isinstance(v, int) and not isinstance(v, bool)
                       and v >= 0, "a layer index (0, 1, ...) or all"),
}
RULES = {TrainSchema: TRAIN_RULES, GenerateSchema: GENERATE_RULES,
         EvalCommandSchema: EVAL_COMMAND_RULES, VizSchema: VIZ_RULES}


def typed(cfg: Any, schema: type):
    """``cfg`` (a composed ``DictConfig`` or a plain dict) as ``schema``'s dataclass, with its
    interpolations resolved; an instance of ``schema`` comes back as it is. A key the schema
    lacks is one ``ConfigKeyError`` line naming the closest valid key."""
    if isinstance(cfg, schema):
        return cfg
    from omegaconf import OmegaConf

    check_keys(cfg, schema)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), cfg))


def settings_problems(settings, rules: dict[str, Rule] | None = None) -> list[str]:
    """Every value of a typed command config that does not fit its type or its rule (``RULES``'
    for its schema and ``rules``: the evaluation's task names, the server's whole table), and a
    model named twice (``ckpt_path`` and ``pretrained``)."""
    problems = field_problems(settings, {**RULES.get(type(settings), {}), **(rules or {})})
    if settings.ckpt_path is not None and settings.pretrained is not None:
        problems.append("give ckpt_path or pretrained, not both")
    return problems


def train_problems(train: TrainSchema) -> list[str]:
    """Every bad value of a training config, one phrase each: single fields (types and
    ``TRAIN_RULES``), then the rules that span fields."""
    return field_problems(train, TRAIN_RULES) + \
        [f"model.{p}" for p in train.model.spanning_problems()] + \
        [f"data.{p}" for p in train.data.spanning_problems()] + spanning_problems(train)


def spanning_problems(train: TrainSchema) -> list[str]:
    """The rules of a training config that span fields."""
    o, t, problems = train.optim, train.trainer, []
    if isinstance(o.lr, float | int) and isinstance(o.min_lr, float | int) and o.min_lr > o.lr > 0:
        problems.append(f"optim.min_lr={o.min_lr} must not exceed optim.lr={o.lr}")
    if o.name == "muon" and o.matrix_optimizer is None:  # the preset's name alone picks no class
        problems.append("optim.name=muon without optim.matrix_optimizer would train with AdamW "
                        "alone: choose optim=muon, or set optim.matrix_optimizer=torch.optim.Muon")
    if o.head_lr is not None and train.model.tie_head:
        problems.append(f"optim.head_lr={o.head_lr} needs model.tie_head=false (a tied head is "
                        "the token embedding): set optim.head_lr=null, and optim.embedding_lr "
                        "for both")
    if t.fsdp.activation_checkpointing and t.activation_checkpointing not in ("none", "blocks"):
        problems.append("trainer.fsdp.activation_checkpointing=true (the old spelling of "
                        "trainer.activation_checkpointing=blocks) contradicts "
                        f"trainer.activation_checkpointing={t.activation_checkpointing.value}: "
                        "drop trainer.fsdp.activation_checkpointing")
    if t.stop_at_target and t.target_val_loss is None:
        problems.append("trainer.stop_at_target=true needs trainer.target_val_loss (the val/loss "
                        "to stop at): set it, or trainer.stop_at_target=false")
    every = train.eval.every  # HellaSwag in training: checked before the first step
    # The HellaSwag validation set (eval.path=null) is English a char vocabulary cannot encode;
    # a local file in the corpus's characters (eval.path) can be scored.
    if isinstance(every, int) and every > 0 and train.data.tokenizer == "char" \
            and train.eval.path is None and "hellaswag" in train.eval.tasks:
        problems.append(f"eval.every={train.eval.every} scores HellaSwag, which needs the GPT-2 "
                        "tokenizer; data.tokenizer=char cannot encode its text: set eval.every=0, "
                        "or train on a dataset tokenized with gpt2")
    return problems
