"""The typed config: one dataclass schema per config group, and the one-line report of a key or
value that does not fit them.

Each ``configs/<group>/*.yaml`` names its schema first in its ``defaults:`` (``- schema``; the
GPT-2 presets ``- /model/schema@model``), Hydra's structured-config schema pattern, so OmegaConf
checks every key and type while it composes: an unknown or misspelled key, added with ``+`` or
not, stops the command before any work. The defaults live here; the YAML files say what users
change and why. Checks that span several fields stay in the code that reads them
(``minigpt.train.config``, ``DataConfig``, ``generate.py``).

``register_schemas()`` puts the schemas in Hydra's ``ConfigStore``; the entry points
(``train.py``, ``generate.py``, ``python -m minigpt.data``) call it before composing, as must
anything that composes ``configs/`` itself (Hydra's compose API in tests or notebooks).
``config_errors()`` turns what Hydra and OmegaConf raise for a bad key or value into one
``error:`` line with the closest valid key, and exit status 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any

from minigpt.data.config import DataConfig
from minigpt.errors import USER_ERROR_EXIT_CODE, UserError


@dataclass
class ModelSchema:
    """``configs/model/*.yaml`` (and ``attention/``, which sets the block's variant fields);
    the defaults are GPT-2 small's (``minigpt.model.GPTConfig``)."""

    name: str = "gpt2_small"
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    context_length: int = 1024
    dropout: float = 0.0
    bias: bool = True
    qkv_bias: bool = True
    vocab_size: int | None = None  # None: the tokenizer's, padded to a multiple of 64
    init_from: str | None = None  # a Hugging Face GPT-2 directory or one of our .ckpt files
    num_kv_heads: int | None = None
    position: str = "learned"
    rope_theta: float = 10000.0
    window: int | None = None
    norm: str = "layernorm"  # the block options of the modern recipe (minigpt.model.GPTConfig)
    qk_norm: bool = False
    mlp: str = "gelu"
    tie_head: bool = True
    zero_init_proj: bool = False
    logit_softcap: float | None = None
    value_embeddings: bool = False


@dataclass
class OptimSchema:
    """``configs/optim/*.yaml``: AdamW (or Muon for the blocks' matrices and AdamW for the rest)
    with warmup and a cosine or warmup-stable-decay schedule."""

    name: str = "adamw"  # adamw | muon
    schedule: str = "cosine"  # cosine | wsd
    cooldown_fraction: float = 0.45  # wsd: the last fraction of decay_steps
    lr: float = 6.0e-4
    min_lr: float = 6.0e-5
    embedding_lr: float | None = None  # the token/position embeddings' AdamW lr; None: lr
    head_lr: float | None = None  # an untied LM head's AdamW lr; None: lr
    warmup_steps: int = 100
    decay_steps: int = "${trainer.max_steps}"  # type: ignore[assignment]  # checked when read
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1.0e-8
    grad_clip: float | None = 1.0  # 0 or None: off
    fused: bool = True
    muon_lr: float = 0.02  # optim=muon: the block matrices' optimizer
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0
    muon_adjust_lr: str | None = "original"  # original | match_rms_adamw
    muon_split_qkv: bool = True  # queries, keys and values one at a time; False: fused


@dataclass
class FSDPSchema:
    sharding_strategy: str = "FULL_SHARD"
    activation_checkpointing: bool = False
    state_dict_type: str = "sharded"


@dataclass
class TrainerSchema:
    """``configs/trainer/*.yaml``: where and how long to train."""

    accelerator: str = "auto"
    devices: Any = "auto"  # auto, a count, or a list of device indices
    num_nodes: int = 1
    strategy: str = "auto"
    precision: str | None = None  # None: picked per device
    max_steps: int = 800
    val_check_interval: int = 200
    limit_val_batches: Any = None  # None, a count of batches or a fraction
    accumulate_grad_batches: int = 1
    log_every_n_steps: int = 10
    enable_progress_bar: bool = True
    target_val_loss: float | None = None  # report steps, tokens, time to the first val at or below
    stop_at_target: bool = False
    fsdp: FSDPSchema = field(default_factory=FSDPSchema)  # read with strategy=fsdp only


@dataclass
class LoggerSchema:
    """``configs/logger/*.yaml``: ``type`` and, for wandb, where the run goes."""

    type: str = "csv"  # wandb | csv | none
    project: str = "minigpt"
    entity: str | None = None
    name: str | None = None
    tags: list[str] = field(default_factory=list)
    mode: str | None = None  # online | offline | disabled; None: online when logged in


@dataclass
class SampleSchema:
    """``sample:`` in ``configs/train.yaml``: the text generated after each validation."""

    prompt: str = "\n"
    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int | None = None


@dataclass
class EvalSchema:
    """``eval:`` of ``configs/train.yaml``: HellaSwag at validations (``minigpt.eval``)."""

    every: int = 0  # every N validations; 0: off
    limit: int | None = 1000  # the first N items; None: all
    path: str | None = None  # a HellaSwag jsonl file; None: the validation set, downloaded once
    batch_size: int = 16


@dataclass
class TrainSchema:
    """``configs/train.yaml``'s own keys; the groups bring theirs."""

    model: ModelSchema = field(default_factory=ModelSchema)
    data: DataConfig = field(default_factory=lambda: DataConfig(name="shakespeare_char"))
    optim: OptimSchema = field(default_factory=OptimSchema)
    trainer: TrainerSchema = field(default_factory=TrainerSchema)
    logger: LoggerSchema = field(default_factory=LoggerSchema)
    sample: SampleSchema = field(default_factory=SampleSchema)
    eval: EvalSchema = field(default_factory=EvalSchema)
    seed: int = 1337
    compile: Any = "auto"  # auto | true | false
    ckpt_path: str | None = None
    data_root: str = "data"
    peak_flops: float | None = None
    threads: int | None = None
    cpu_speedups: Any = "auto"  # auto | false


@dataclass
class PrepareSchema:
    """``configs/prepare.yaml`` (``python -m minigpt.data``)."""

    data: DataConfig = field(default_factory=lambda: DataConfig(name="shakespeare_char"))
    data_root: str = "data"


@dataclass
class GenerateSchema:
    """``configs/generate.yaml`` (``generate.py``)."""

    ckpt_path: str | None = None
    checkpoints_root: str = "outputs"
    pretrained: str | None = None
    prompt: str = ""
    prompt_file: str | None = None
    prompts: str | None = None  # @file.txt: one prompt per line, sampled as one batch
    max_new_tokens: int = 500
    temperature: float = 0.8
    top_k: int | None = 200
    top_p: float | None = None
    num_samples: int = 1
    seed: int = 1337
    device: str = "auto"
    dtype: str = "auto"
    decoder: str = "auto"
    cpu_speedups: Any = "auto"  # auto | false
    stream: bool | None = None
    stop_at_eot: bool = True
    crop_to: int | None = None
    attention_map: str | None = None
    attention_layer: Any = 0  # a layer index, or all


# (group, schema): each group's YAML files start with `defaults: [schema]`.
GROUP_SCHEMAS = (("model", ModelSchema), ("data", DataConfig), ("optim", OptimSchema),
                 ("trainer", TrainerSchema), ("logger", LoggerSchema))
# (name, schema) of the primary configs, named first in train/prepare/generate.yaml's defaults.
PRIMARY_SCHEMAS = (("train_schema", TrainSchema), ("prepare_schema", PrepareSchema),
                   ("generate_schema", GenerateSchema))


def register_schemas() -> None:
    """Store every schema in Hydra's ``ConfigStore`` (idempotent): ``<group>/schema`` and the
    primary configs' ``train_schema``, ``prepare_schema``, ``generate_schema``."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for group, schema in GROUP_SCHEMAS:
        store.store(group=group, name="schema", node=schema)
    for name, schema in PRIMARY_SCHEMAS:
        store.store(name=name, node=schema)


# ------------------------------------------------------------------------- one-line reports

# Names other trainers use (nanoGPT's, Hugging Face's) -> ours, for "did you mean".
ALIASES = {"learning_rate": "lr", "lr_min": "min_lr", "min_learning_rate": "min_lr",
           "warmup_iters": "warmup_steps", "lr_decay_iters": "decay_steps", "max_iters": "max_steps",
           "block_size": "context_length", "n_positions": "context_length",
           "n_ctx": "context_length", "eval_interval": "val_check_interval",
           "log_interval": "log_every_n_steps", "grad_norm_clip": "grad_clip",
           "gradient_accumulation_steps": "accumulate_grad_batches", "max_grad_norm": "grad_clip"}


class ConfigKeyError(UserError, KeyError):
    """A config key no schema has (a misspelling, or one added with ``+``)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def _fields(schema: type) -> dict[str, Any]:
    """``{field name: resolved type}`` of a dataclass schema."""
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def _dataclass_of(annotation) -> type | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if dataclasses.is_dataclass(candidate):
            return candidate
    return None


def schema_keys(schema: type) -> list[str]:
    """Every dotted key a schema accepts (``optim.lr``, ``trainer.fsdp.sharding_strategy``...)."""
    keys = []
    for name, annotation in _fields(schema).items():
        keys.append(name)
        inner = _dataclass_of(annotation)
        if inner is not None:
            keys += [f"{name}.{k}" for k in schema_keys(inner)]
    return keys


def closest_key(key: str, schema: type) -> str | None:
    """The valid key most like ``key`` (under the same parent first), or None if none is close."""
    keys = schema_keys(schema)
    parent, _, leaf = key.rpartition(".")
    siblings = [k for k in keys if k.rpartition(".")[0] == parent]
    alias = ALIASES.get(leaf)
    for pool in (siblings, keys):
        if alias and (k := next((k for k in pool if k.rpartition(".")[2] == alias), None)):
            return k
        leaves = {k.rpartition(".")[2]: k for k in pool}
        match = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.6)
        if match:
            return leaves[match[0]]
    return None


def unknown_keys(cfg: Any, schema: type, prefix: str = "") -> list[str]:
    """The dotted keys of ``cfg`` (a dict or ``DictConfig``) that ``schema`` does not have."""
    if not isinstance(cfg, dict):
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_container(cfg, resolve=False)
    fields, found = _fields(schema), []
    for key, value in cfg.items():
        if key not in fields:
            found.append(f"{prefix}{key}")
        elif isinstance(value, dict) and (inner := _dataclass_of(fields[key])) is not None:
            found += unknown_keys(value, inner, f"{prefix}{key}.")
    return found


def added_unknown_keys(overrides: list[str], schema: type) -> list[str]:
    """The dotted keys that command-line ``+key=value`` / ``++key=value`` overrides would add
    under one of ``schema``'s config groups without being in it (checked before Hydra composes,
    so nothing is written first); a key under a field typed ``Any`` may be anything."""
    fields, found = _fields(schema), []
    for override in overrides:
        key = override.lstrip("+").partition("=")[0]
        if not override.startswith("+") or "." not in key or "@" in key:
            continue
        annotation = fields.get(key.partition(".")[0])
        if _dataclass_of(annotation) is None:
            continue  # not a group of this schema (hydra.*, a config group's own defaults)
        for part in key.split(".")[1:]:
            inner = _fields(_dataclass_of(annotation))
            if part not in inner:
                found.append(key)
                break
            annotation = inner[part]
            if _dataclass_of(annotation) is None:
                break  # a leaf, or a field typed Any: whatever lies under it is its own
    return found


def check_keys(cfg: Any, schema: type) -> None:
    """Raise ``ConfigKeyError`` (one line, each unknown key with the closest valid one) unless
    every key of the composed ``cfg`` is in ``schema``: the check Hydra skips for a key added
    with ``+``. Entry points call it first, inside ``one_line_errors``."""
    unknown = unknown_keys(cfg, schema)
    if unknown:
        raise ConfigKeyError("; ".join(_unknown_key(key, schema) for key in unknown))


def _unknown_key(key: str, schema: type) -> str:
    near = closest_key(key, schema)
    return f"unknown config key {key}: " + (f"did you mean {near}?" if near else
                                            "see configs/ for the valid keys")


def describe_config_error(error: BaseException, schema: type) -> str | None:
    """One line for an error Hydra or OmegaConf raised while composing a config against
    ``schema`` (an unknown key, a value of the wrong type, a missing group option, an override
    that does not parse), or None if ``error`` is something else."""
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, OmegaConfBaseException, ValidationError
    from omegaconf.errors import ConfigKeyError as OmegaConfKeyError

    chain, e = [], error
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    if not any(isinstance(e, (HydraException, OmegaConfBaseException)) for e in chain):
        return None
    for e in chain:
        full_key = getattr(e, "full_key", None)
        if isinstance(e, (OmegaConfKeyError, ConfigAttributeError)) and full_key:
            return _unknown_key(full_key, schema)
        if isinstance(e, ValidationError) and full_key:
            reason = _first_line(getattr(e, "msg", "") or str(e))
            return f"{full_key}={getattr(e, 'value', '?')!r} does not fit its type: {reason}"
        if isinstance(e, MissingConfigException):
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            options = [line for line in lines[2:] if not line.startswith(("Config search",
                                                                           "provider="))]
            listed = ", ".join(o for o in options if o != "schema")
            return f"{lines[0]}" + (f"; {lines[1].rstrip(':').lower()}: {listed}" if listed
                                    else "")
        if isinstance(e, OverrideParseException):
            return f"cannot read the override {e.override!r}: {_first_line(e.message)} (see " \
                   "https://hydra.cc/docs/advanced/override_grammar/basic)"
    lines = [line.strip() for line in str(chain[0]).splitlines() if line.strip()]
    return "bad config or override: " + "; ".join(
        line for line in lines if not line.startswith("See https"))


def _first_line(text: str) -> str:
    return (str(text).strip().splitlines() or [""])[0]


@contextlib.contextmanager
def config_errors(schema: type):
    """Around an entry point's Hydra ``main()``: what Hydra or OmegaConf raises for a bad key or
    value becomes ``error: <one line>`` on stderr and exit status 2; so does a key added with
    ``+`` on the command line that the schema lacks, before Hydra composes (or makes a run
    directory). Hydra raises (rather than prints) only with ``HYDRA_FULL_ERROR=1``, which this
    sets for the process."""
    unknown = added_unknown_keys(sys.argv[1:], schema)
    if unknown:
        print("error: " + "; ".join(_unknown_key(key, schema) for key in unknown),
              file=sys.stderr, flush=True)
        raise SystemExit(USER_ERROR_EXIT_CODE)
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    except Exception as e:
        message = describe_config_error(e, schema)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(USER_ERROR_EXIT_CODE) from None
