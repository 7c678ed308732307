"""The typed config: one dataclass per config group and per command, each field's default and
comment declared once here (the model's on ``minigpt.model.GPTConfig``). Each
``configs/<group>/*.yaml`` names its schema first in ``defaults:`` (Hydra's structured-config
pattern), so OmegaConf checks keys and types while composing; ``rules`` checks the values.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any

from minigpt.data.config import DataConfig
from minigpt.model import GPTConfig
from minigpt.paths import (
    INPUT_DIR,
    INPUT_FILE,
    INPUT_FILE_OR_DIR,
    NO_MODEL,
    NOT_A_PATH,
    OUTPUT_DIR,
    OUTPUT_FILE,
    no_model_given,
    path_field,
)


def _prepares_tokens(settings, _root) -> bool:  # data_root is read only then
    return settings.data.source not in ("shards", "chat")


class ActivationCheckpointing(str, enum.Enum):
    """``trainer.activation_checkpointing``'s values (a ``str``: ``mode == "blocks"`` holds);
    ``minigpt.train.activation_checkpointing`` says what each recomputes."""

    none = "none"
    blocks = "blocks"
    selective = "selective"


@dataclass
class ModelSchema(GPTConfig):
    """``configs/model/*.yaml`` and ``configs/attention/``: ``GPTConfig``'s fields (its defaults
    are GPT-2 small's) and two of the run's own. Not checked when built (``vocab_size`` may still
    be null): ``minigpt.config.rules`` checks it with the rest of the run's config."""

    vocab_size: int | None = None  # null: the tokenizer's, padded to a multiple of 64; set to pin
    name: str = "gpt2_small"  # the preset, named in the run's description
    # fine-tune: a Hugging Face GPT-2 directory or one of our .ckpt
    init_from: str | None = path_field(INPUT_FILE_OR_DIR, hub_name=True)

    def __post_init__(self):
        pass  # checked with every other setting (minigpt.train.config.check_config)

    def gpt_config(self, vocab_size: int) -> GPTConfig:
        """The ``GPTConfig`` to build, with the vocabulary the data gave."""
        return GPTConfig(**{**{f.name: getattr(self, f.name) for f in fields(GPTConfig)},
                            "vocab_size": vocab_size})


@dataclass
class DataSchema(DataConfig):
    """``configs/data/*.yaml``: ``DataConfig``'s fields, not checked when built: a run checks them
    with the rest of its config, preparation when it takes them (``DataConfig.from_any``)."""

    def __post_init__(self):
        pass


@dataclass
class OptimSchema:
    """``configs/optim/*.yaml``: an optimizer class for the whole model (AdamW), or one for the
    blocks' 2-D matrices (``optim=muon``: Muon) beside it for the rest, with linear warmup and a
    cosine or warmup-stable-decay schedule; the defaults are GPT-2's (nanoGPT's). The classes
    are dotted paths of ``torch.optim.Optimizer`` subclasses, a user's own included
    (docs/extending.md)."""

    name: str = "adamw"  # the preset's name (its file in configs/optim/), shown in descriptions
    optimizer: str = "torch.optim.AdamW"  # the whole model's, or all but the block matrices'
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)  # more arguments of its class
    matrix_optimizer: str | None = None  # the blocks' 2-D matrices' (optim=muon: Muon); null: none
    matrix_kwargs: dict[str, Any] = field(default_factory=dict)  # more arguments of its class
    schedule: str = "cosine"  # cosine | wsd: warmup, lr held, then a linear cooldown to min_lr
    cooldown_fraction: float = 0.45  # wsd: the last fraction of decay_steps spent cooling down
    lr: float = 6.0e-4  # AdamW's peak learning rate
    min_lr: float = 6.0e-5  # reached at decay_steps; the same fraction of every group's peak
    embedding_lr: float | None = None  # the token/position embeddings' peak lr; null: lr
    head_lr: float | None = None  # an untied LM head's peak lr; null: lr
    warmup_steps: int = 100  # optimizer steps of linear warmup
    decay_steps: int = "${trainer.max_steps}"  # type: ignore[assignment]  # the schedule's end
    weight_decay: float = 0.1  # on the linear layers' weight matrices only
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1.0e-8
    grad_clip: float | None = 1.0  # clip the global gradient norm; 0 or null: off
    fused: bool = True  # AdamW's fused kernel where the device and precision allow it
    muon_lr: float = 0.02  # the matrix optimizer's peak lr (Muon's, or any matrix_optimizer's)
    muon_momentum: float = 0.95  # its Nesterov momentum, where its class takes momentum
    muon_weight_decay: float = 0.0
    muon_adjust_lr: str | None = "original"  # original: lr x sqrt(max(1, rows/cols));
    # match_rms_adamw: AdamW-like update sizes
    muon_split_qkv: bool = True  # queries, keys and values one at a time; false: the fused matrix


@dataclass
class FSDPSchema:
    """``trainer.fsdp`` (read with ``trainer.strategy=fsdp`` only)."""

    sharding_strategy: str = "FULL_SHARD"  # or SHARD_GRAD_OP, HYBRID_SHARD (multi-node)
    activation_checkpointing: bool = False  # old spelling: trainer.activation_checkpointing=blocks
    state_dict_type: str = "sharded"  # or full: one .ckpt gathered on rank 0


@dataclass
class TrainerSchema:
    """``configs/trainer/*.yaml``: where and how long to train."""

    accelerator: str = "auto"  # auto | cpu | gpu (Lightning's names)
    devices: Any = "auto"  # auto, a count, or a list of device indices
    num_nodes: int = 1
    strategy: str = "auto"  # auto | ddp | fsdp
    precision: str | None = None  # null: bf16-mixed where bf16 is native, 16-mixed on older GPUs,
    # else 32-true
    max_steps: int = 800  # optimizer steps
    val_check_interval: int = 200  # optimizer steps between validations (and checkpoints)
    limit_val_batches: Any = None  # null: the whole validation budget; a count or a fraction
    accumulate_grad_batches: int = 1  # micro-batches per step; derived from data.tokens_per_step
    memory_budget: Any = None  # null, bytes, or a size such as 8GB / 12GiB: the most memory a
    # training step may use (data.batch_size=auto stays under it; the preflight checks it)
    log_every_n_steps: int = 10
    enable_progress_bar: bool = True
    target_val_loss: float | None = None  # report steps, tokens, time to the first val <= this
    stop_at_target: bool = False  # and stop there (needs target_val_loss)
    # none | blocks | selective: what backward recomputes (minigpt.train.activation_checkpointing)
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.none
    fsdp: FSDPSchema = field(default_factory=FSDPSchema)


@dataclass
class LoggerSchema:
    """``configs/logger/*.yaml``: ``type`` and, for wandb, where the run goes."""

    type: str = "csv"  # wandb | csv | none
    project: str = "minigpt"
    entity: str | None = None
    name: str | None = None
    tags: list[str] = field(default_factory=list)
    mode: str | None = None  # online | offline | disabled; null: online when logged in


@dataclass
class SampleSchema:
    """``sample:`` in ``configs/train.yaml``: the text generated after each validation."""

    prompt: str = path_field(NOT_A_PATH, "\n")  # text
    max_new_tokens: int = 200  # 0: no samples
    temperature: float = 0.8
    top_k: int | None = None


@dataclass
class EvalSchema:
    """``eval:`` of ``configs/train.yaml``: evaluation tasks at validations (``minigpt.eval``),
    logged as ``eval/<task>/<metric>``."""

    tasks: list[str] = field(default_factory=lambda: ["hellaswag"])  # names or dotted paths
    every: int = 0  # every N validations; 0: off
    limit: int | None = 1000  # the first N items of each task; null: all
    path: str | None = path_field(INPUT_FILE)  # the tasks' item file (HellaSwag's jsonl); null:
    # each task's own default set, downloaded once
    batch_size: int = 16  # items per forward pass (HellaSwag: four rows each)


@dataclass
class TrainSchema:
    """``configs/train.yaml``'s own keys; the groups bring theirs."""

    model: ModelSchema = field(default_factory=ModelSchema)
    data: DataSchema = field(default_factory=lambda: DataSchema(name="shakespeare_char"))
    optim: OptimSchema = field(default_factory=OptimSchema)
    trainer: TrainerSchema = field(default_factory=TrainerSchema)
    logger: LoggerSchema = field(default_factory=LoggerSchema)
    sample: SampleSchema = field(default_factory=SampleSchema)
    eval: EvalSchema = field(default_factory=EvalSchema)
    seed: int = 1337
    compile: Any = "auto"  # auto (on GPUs) | true (the loss as one graph) | blocks (each
    # transformer block compiled on its own, once) | false
    # resume: last (the newest outputs/**/last.ckpt) or a path
    ckpt_path: str | None = path_field(INPUT_FILE_OR_DIR, words=("last",))
    # prepared token files live in <data_root>/<data.name>/ (token shards and chat: none)
    data_root: str = path_field(OUTPUT_DIR, "data", when=_prepares_tokens)
    peak_flops: float | None = None  # device peak FLOP/s for MFU where not known
    threads: int | None = None  # CPU threads per process; null: torch's default
    cpu_speedups: Any = "auto"  # auto | false


@dataclass
class PrepareSchema:
    """``configs/prepare.yaml`` (``python -m minigpt.data``)."""

    data: DataSchema = field(default_factory=lambda: DataSchema(name="shakespeare_char"))
    data_root: str = path_field(OUTPUT_DIR, "data", when=_prepares_tokens)


@dataclass
class GenerateSchema:
    """``configs/generate.yaml`` (``generate.py``)."""

    ckpt_path: str | None = path_field(INPUT_FILE_OR_DIR)
    checkpoints_root: str = path_field(INPUT_DIR, "outputs", when=no_model_given,
                                       missing=NO_MODEL)
    pretrained: str | None = path_field(INPUT_DIR, hub_name=True)
    prompt: str = path_field(INPUT_FILE, "", at_file=True)  # text, or @file.txt
    prompt_file: str | None = path_field(INPUT_FILE)
    # @file.txt: one prompt per line, sampled as one batch
    prompts: str | None = path_field(INPUT_FILE, at_file=True)
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
    attention_map: str | None = path_field(OUTPUT_FILE)  # a PNG
    attention_layer: Any = 0  # a layer index, or all
    chat: bool = False  # talk with a fine-tuned chat model in the terminal (minigpt.chat)
    # chat: answer each conversation of this .jsonl instead
    chat_input: str | None = path_field(INPUT_FILE)
    # chat_input: write {"reply", "reference"} lines here
    chat_output: str | None = path_field(OUTPUT_FILE)
    chat_template: str | None = None  # null: the checkpoint's; default: the untrained template


@dataclass
class EvalCommandSchema:
    """``configs/eval.yaml`` (``python -m minigpt.eval``)."""

    task: str = "hellaswag"  # hellaswag | chat | harness (first argument) | a Task's dotted path
    ckpt_path: str | None = path_field(INPUT_FILE_OR_DIR)  # null: the newest under checkpoints_root
    checkpoints_root: str = path_field(INPUT_DIR, "outputs", when=no_model_given,
                                       missing=NO_MODEL)
    pretrained: str | None = path_field(INPUT_DIR, hub_name=True)  # a Hugging Face GPT-2 dir
    path: str | None = path_field(INPUT_FILE)  # the task's items; null: its default set
    # where the default set is downloaded once (without path)
    cache_dir: str = path_field(OUTPUT_DIR, "data/eval", when=lambda e, _: e.path is None)
    limit: int | None = None  # the first N items (harness: per task); null: all
    batch_size: int = 16  # HellaSwag: items per forward pass (4 rows each); harness: rows
    out: str | None = path_field(OUTPUT_FILE)  # write the result as JSON here
    progress: bool = True  # a progress bar on stderr
    device: str = "auto"  # auto: cuda if available, else cpu
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    tasks: Any = None  # harness: lm-eval task names (tasks=lambada_openai,arc_easy)
    num_fewshot: int | None = None  # harness: examples in each prompt; null: each task's default
    include_path: str | None = path_field(INPUT_DIR)  # harness: a directory of your task YAMLs
    max_gen_toks: int = 256  # harness: tokens generated when a task sets no limit
    apply_chat_template: bool = False  # harness: prompts as conversations in the chat template
    chat_template: str | None = None  # task=chat, apply_chat_template: null = the checkpoint's;
    # default: the untrained template


@dataclass
class VizSchema:
    """``configs/viz.yaml`` (``python -m minigpt.viz attention|runs``)."""

    command: str = "attention"  # attention | runs (the first argument sets it)
    out: str | None = path_field(OUTPUT_FILE)  # the PNG to write; null: <command>.png
    # attention: heatmaps of a model's attention weights over a prompt
    ckpt_path: str | None = path_field(INPUT_FILE_OR_DIR)  # null: the newest under checkpoints_root
    checkpoints_root: str = path_field(INPUT_DIR, "outputs", when=lambda v, root: v.command ==
                                       "attention" and no_model_given(v, root), missing=NO_MODEL)
    pretrained: str | None = path_field(INPUT_DIR, hub_name=True)  # a Hugging Face GPT-2 dir
    prompt: str | None = path_field(NOT_A_PATH)  # null: the opening line of Coriolanus
    prompt_file: str | None = path_field(INPUT_FILE)  # read the prompt from this file instead
    layer: Any = 0  # a layer index (one heatmap per head), or all (one per layer, mean of heads)
    cpu_speedups: Any = "auto"  # auto | false: oneDNN-packed linear weights on the CPU
    device: str = "auto"  # auto: cuda if available, else cpu
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (minigpt/devices.py's rule)
    # runs: loss, learning rate and tokens/s of training runs' directories (csv/metrics.csv)
    runs: list[str] = path_field(INPUT_DIR, default_factory=list,
                                 when=lambda v, _: v.command == "runs")
    labels: list[str] | None = None  # legend names, one per run; null: the paths
    title: str | None = None  # the figure's title


# (group, schema): each group's YAML files start with `defaults: [schema]`.
GROUP_SCHEMAS = (("model", ModelSchema), ("data", DataSchema), ("optim", OptimSchema),
                 ("trainer", TrainerSchema), ("logger", LoggerSchema))


def register_schemas() -> None:
    """Store every schema in Hydra's ``ConfigStore`` (idempotent): ``<group>/schema`` and the
    ``<command>_schema`` that train/prepare/generate/eval/viz.yaml name first. Anything that
    composes ``configs/`` (entry points; Hydra's compose API in tests) calls it first."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for group, schema in GROUP_SCHEMAS:
        store.store(group=group, name="schema", node=schema)
    for name, schema in (("train", TrainSchema), ("prepare", PrepareSchema),
                         ("generate", GenerateSchema), ("eval", EvalCommandSchema),
                         ("viz", VizSchema)):
        store.store(name=f"{name}_schema", node=schema)
