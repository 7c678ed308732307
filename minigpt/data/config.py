"""``DataConfig``: one ``configs/data/*.yaml`` as a validated dataclass, and ``DataError``."""

from __future__ import annotations

import dataclasses
import encodings
from dataclasses import dataclass
from typing import Any

from minigpt.errors import UserError
from minigpt.field_rules import OneOf, Range, Satisfies, field_problems
from minigpt.paths import INPUT_GLOBS, NOT_A_PATH, OUTPUT_DIR, PATHS_INSIDE, path_field
from minigpt.tokenizer import TIKTOKEN_ENCODINGS

SOURCES = ("shakespeare", "files", "hub", "shards", "chat")  # built in (shards: read as they
# are; chat: conversations, minigpt.data.chat)
FORMATS = ("auto", "text", "json", "parquet", "csv")
SAMPLE_BY = ("document", "line", "paragraph")
VAL_SPLITS = ("tail", "document")
ALIGNS = ("window", "bos")
PACKINGS = ("in_order", "best_fit")
SAMPLINGS = ("random", "epoch")
AT_LEAST_1 = Range(1)
POSITIVE_INTEGER = Satisfies(lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                             "a positive integer")
# The one table of DataConfig's single-field rules (its types come from the annotations); a
# training run's data.* checks are these too (minigpt.config.rules).
DATA_RULES = {
    "name": Satisfies(lambda n: bool(n) and "/" not in n and n not in (".", ".."),
                      "a plain directory name"),
    "source": Satisfies(lambda s: s in SOURCES or isinstance(s, str) and "." in s.strip("."),
                        f"one of {', '.join(SOURCES)}, or the dotted path of a function or class "
                        "yielding documents (docs/extending.md)"),
    "tokenizer": OneOf(("char", *TIKTOKEN_ENCODINGS)),
    "format": OneOf(FORMATS), "sample_by": OneOf(SAMPLE_BY), "val_split": OneOf(VAL_SPLITS),
    "align": OneOf(ALIGNS), "packing": OneOf(PACKINGS), "sampling": OneOf(SAMPLINGS),
    # Python's own codecs (not codecs.lookup: a search function a package registers may accept
    # any name)
    "encoding": Satisfies(lambda name: isinstance(name, str) and encodings.search_function(
        name.lower()) is not None, "an encoding Python knows (e.g. utf-8, latin-1, cp1252, "
        "utf-16)"),
    "val_fraction": Range(0, 1, low_open=True, high_open=True),
    "num_workers": Range(0),
    "batch_size": POSITIVE_INTEGER,  # a training config also takes auto (minigpt.config.rules)
    **dict.fromkeys(("num_proc", "val_tokens", "max_documents", "max_tokens",
                     "val_batch_size", "tokens_per_step"), AT_LEAST_1),
}


# The sources that read each source-specific setting (minigpt.data.sources, minigpt.data.chat).
READ_BY = {"paths": ("files", "chat"), "hub_name": ("hub", "chat"), "hub_config": ("hub", "chat"),
           "data_files": ("hub",), "revision": ("hub", "chat"), "streaming": ("hub", "files"),
           "train_shards": ("shards",), "val_shards": ("shards",),
           "source_args": ("chat", "a dotted path")}


class DataError(UserError, ValueError):
    """Bad data input or configuration; the message is one line naming the value and the fix."""


@dataclass
class DataConfig:
    """What to tokenize and how, and how to batch it; only the fields marked [prepare] feed the
    fingerprint that decides whether prepared files are reused."""

    name: str  # [prepare] directory under data_root
    source: str = "shakespeare"  # [prepare] shakespeare | files | hub | shards | a dotted path of your own
    # [prepare] its keyword arguments (chat: ChatSettings)
    source_args: dict[str, Any] = path_field(PATHS_INSIDE, default_factory=dict,
                                             inside="minigpt.data.chat.ChatSettings",
                                             when=lambda data, _: data.source == "chat")
    tokenizer: str = "gpt2"  # [prepare] char | gpt2 | r50k_base | p50k_base | cl100k_base | o200k_base
    # files: local paths or globs (relative to the working directory)
    paths: list[str] = path_field(INPUT_GLOBS, default_factory=list)  # [prepare]
    format: str = "auto"  # [prepare] auto (by extension) | text | json | parquet | csv
    sample_by: str = "document"  # [prepare] .txt: a document per file, line or paragraph
    text_field: str = "text"  # [prepare] column holding the text (json/parquet/csv/hub)
    encoding: str = "utf-8"  # [prepare] text/json/csv files: their encoding (e.g. latin-1, utf-16)
    # hub: datasets.load_dataset(hub_name, hub_config, data_files=..., split=..., streaming=...)
    hub_name: str | None = None  # [prepare]
    hub_config: str | None = None  # [prepare]
    data_files: Any = path_field(NOT_A_PATH)  # [prepare] in the hub dataset, or local files
    split: str = "train"  # [prepare]
    revision: str | None = None  # [prepare]
    streaming: bool = False  # [prepare]
    # shards: llm.c .bin token shards (GPT-2 ids), used as they are (minigpt.data.shards)
    train_shards: str | None = path_field(INPUT_GLOBS)  # glob of the training shards
    val_shards: str | None = path_field(INPUT_GLOBS)  # glob of the validation shards
    max_documents: int | None = None  # [prepare] cap on documents read
    max_tokens: int | None = None  # [prepare] stop after the document reaching this many tokens
    val_fraction: float = 0.1  # [prepare]
    val_split: str = "tail"  # [prepare] tail: last fraction of each document; document: whole docs
    num_proc: int = 1  # processes for datasets.map (tokenizer threads fill the remaining cores)
    # datasets cache for files/hub (None: the Hugging Face default)
    cache_dir: str | None = path_field(OUTPUT_DIR)
    batch_size: Any = 32  # training micro-batch size (per process); a training run takes auto
    tokens_per_step: int | None = None  # global batch in tokens; None: trainer.accumulate_grad_batches
    val_batch_size: int | None = None  # default: batch_size
    num_workers: int = 0  # DataLoader workers
    val_tokens: int = 65536  # validation token budget: val_tokens // context_length fixed windows
    # window: rows cut anywhere (nanoGPT); bos: every row starts at a document's first token,
    # the documents after it packed in order (minigpt.data.bos)
    align: str = "window"
    # align=bos: in_order (the documents that follow, the last cut at the row's end) | best_fit
    # (whole documents, the longest that fits, one cropped only when none fits; nanochat's)
    packing: str = "in_order"
    # random: rows drawn with replacement, a pure function of (seed, rank, batch); epoch: every
    # row once per epoch in a seeded order, processes disjoint (minigpt.data.epochs)
    sampling: str = "random"

    def __post_init__(self):
        if isinstance(self.paths, str):
            self.paths = [self.paths]
        self.paths = [str(p) for p in self.paths or []]
        problems = self.problems()
        if problems:
            raise DataError("bad data config: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Every bad value, one phrase each: the fields against their types and ``DATA_RULES``,
        then the rules across fields."""
        return field_problems(self, DATA_RULES) + self.spanning_problems()

    def spanning_problems(self) -> list[str]:
        """What a source needs besides itself, and settings given (not their defaults) that this
        source or alignment never reads: a run would go on without them, unnoticed."""
        needs = {"files": (self.paths, "source=files needs paths (files or globs)"),
                 "hub": (self.hub_name, "source=hub needs hub_name"),
                 "shards": (self.train_shards and self.val_shards,
                            "source=shards needs train_shards and val_shards (globs)"),
                 "chat": (self.paths or self.hub_name,
                          "source=chat needs paths (.jsonl files) or hub_name")}
        given, problem = needs.get(self.source, (True, ""))
        defaults = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING
                    else f.default for f in dataclasses.fields(DataConfig)}
        source = self.source if self.source in SOURCES else "a dotted path"
        problems = [] if given else [problem]
        problems += [f"{key}={getattr(self, key)!r} is read only by source={' or '.join(readers)}, "
                     f"not by source={self.source}: drop it, or choose a source that reads it"
                     for key, readers in READ_BY.items()
                     if source not in readers and getattr(self, key) != defaults[key]]
        if self.source == "shards" and self.tokenizer != "gpt2":
            problems.append(f"tokenizer={self.tokenizer} does nothing with source=shards (llm.c "
                            "shards hold GPT-2 ids): drop it")
        if self.packing != "in_order" and self.align != "bos":
            problems.append(f"packing={self.packing} packs documents into BOS-aligned rows and "
                            f"does nothing with align={self.align}: add data.align=bos, or drop "
                            "data.packing")
        return problems

    @classmethod
    def from_any(cls, cfg: Any) -> DataConfig:
        """From a ``DataConfig``, a dict or an OmegaConf ``DictConfig``; unknown keys are errors."""
        if isinstance(cfg, cls):  # a schema's unchecked subclass (checked with its run) too
            return cfg if type(cfg) is cls else cls(**{f.name: getattr(cfg, f.name)
                                                       for f in dataclasses.fields(cls)})
        if not isinstance(cfg, dict):  # DictConfig; imported lazily to keep this module light
            from omegaconf import OmegaConf

            cfg = OmegaConf.to_container(cfg, resolve=True)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise DataError(f"unknown data config field(s) {unknown}; known fields: {sorted(known)}")
        if "name" not in cfg:
            raise DataError("data config needs a name (the directory under data/)")
        return cls(**cfg)

