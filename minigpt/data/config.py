"""``DataConfig``: one ``configs/data/*.yaml`` as a validated dataclass, and ``DataError``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from minigpt.errors import UserError
from minigpt.tokenizer import TIKTOKEN_ENCODINGS

SOURCES = ("shakespeare", "files", "hub")
FORMATS = ("auto", "text", "json", "parquet", "csv")
SAMPLE_BY = ("document", "line", "paragraph")
VAL_SPLITS = ("tail", "document")


class DataError(UserError, ValueError):
    """Bad data input or configuration; the message is one line naming the value and the fix."""


@dataclass
class DataConfig:
    """What to tokenize and how (preparation), and how to batch it (the DataModule).

    Only the fields marked [prepare] feed the fingerprint that decides whether prepared files are
    reused; the rest can change freely between runs.
    """

    name: str  # [prepare] directory under data_root
    source: str = "shakespeare"  # [prepare] shakespeare | files | hub
    tokenizer: str = "gpt2"  # [prepare] char | gpt2 | r50k_base | p50k_base | cl100k_base | o200k_base
    # files: local paths or globs (relative to the working directory)
    paths: list[str] = field(default_factory=list)  # [prepare]
    format: str = "auto"  # [prepare] auto (by extension) | text | json | parquet | csv
    sample_by: str = "document"  # [prepare] .txt: a document per file, line or paragraph
    text_field: str = "text"  # [prepare] column holding the text (json/parquet/csv/hub)
    encoding: str = "utf-8"  # [prepare] text/json/csv files: their encoding (e.g. latin-1, utf-16)
    # hub: datasets.load_dataset(hub_name, hub_config, data_files=..., split=..., streaming=...)
    hub_name: str | None = None  # [prepare]
    hub_config: str | None = None  # [prepare]
    data_files: Any = None  # [prepare]
    split: str = "train"  # [prepare]
    revision: str | None = None  # [prepare]
    streaming: bool = False  # [prepare]
    max_documents: int | None = None  # [prepare] cap on documents read
    max_tokens: int | None = None  # [prepare] stop after the document reaching this many tokens
    val_fraction: float = 0.1  # [prepare]
    val_split: str = "tail"  # [prepare] tail: last fraction of each document; document: whole docs
    num_proc: int = 1  # processes for datasets.map (tokenizer threads fill the remaining cores)
    cache_dir: str | None = None  # datasets cache for files/hub (None: the Hugging Face default)
    batch_size: int = 32  # training micro-batch size (per process)
    tokens_per_step: int | None = None  # global batch in tokens; None: trainer.accumulate_grad_batches
    val_batch_size: int | None = None  # default: batch_size
    num_workers: int = 0  # DataLoader workers
    val_tokens: int = 65536  # validation token budget: val_tokens // context_length fixed windows

    def __post_init__(self):
        if isinstance(self.paths, str):
            self.paths = [self.paths]
        self.paths = [str(p) for p in self.paths or []]
        problems = []

        def bad(cond: bool, msg: str):
            if cond:
                problems.append(msg)

        bad(not isinstance(self.name, str) or not self.name or "/" in self.name or self.name in (".", ".."),
            f"name={self.name!r} must be a plain directory name")
        bad(self.source not in SOURCES, f"source={self.source!r} must be one of {SOURCES}")
        bad(self.tokenizer != "char" and self.tokenizer not in TIKTOKEN_ENCODINGS,
            f"tokenizer={self.tokenizer!r} must be 'char' or one of {TIKTOKEN_ENCODINGS}")
        bad(self.format not in FORMATS, f"format={self.format!r} must be one of {FORMATS}")
        bad(self.sample_by not in SAMPLE_BY, f"sample_by={self.sample_by!r} must be one of {SAMPLE_BY}")
        bad(not _known_encoding(self.encoding),
            f"encoding={self.encoding!r} is not an encoding Python knows (e.g. utf-8, latin-1, "
            "cp1252, utf-16)")
        bad(self.val_split not in VAL_SPLITS, f"val_split={self.val_split!r} must be one of {VAL_SPLITS}")
        bad(self.source == "files" and not self.paths, "source=files needs paths (files or globs)")
        bad(self.source == "hub" and not self.hub_name, "source=hub needs hub_name")
        bad(not 0.0 < float(self.val_fraction) < 1.0, f"val_fraction={self.val_fraction} must be in (0, 1)")
        for key, low in (("num_proc", 1), ("batch_size", 1), ("num_workers", 0), ("val_tokens", 1)):
            value = getattr(self, key)
            bad(not isinstance(value, int) or value < low, f"{key}={value!r} must be an integer >= {low}")
        for key in ("max_documents", "max_tokens", "val_batch_size", "tokens_per_step"):
            value = getattr(self, key)
            bad(value is not None and (not isinstance(value, int) or value < 1),
                f"{key}={value!r} must be null or an integer >= 1")
        if problems:
            raise DataError("bad data config: " + "; ".join(problems))

    @classmethod
    def from_any(cls, cfg: Any) -> DataConfig:
        """From a ``DataConfig``, a dict or an OmegaConf ``DictConfig``; unknown keys are errors."""
        if isinstance(cfg, cls):
            return cfg
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

    def prepare_settings(self) -> dict:
        """The [prepare] fields: what the prepared token files depend on."""
        keys = ("source", "tokenizer", "val_fraction", "val_split", "max_documents", "max_tokens")
        per_source = {
            "shakespeare": (),
            "files": ("format", "sample_by", "text_field")
            + (("encoding",) if self.encoding != "utf-8" else ()),  # utf-8 keeps old fingerprints
            "hub": ("hub_name", "hub_config", "data_files", "split", "revision", "text_field"),
        }[self.source]
        return {k: getattr(self, k) for k in keys + per_source}


def _known_encoding(name) -> bool:
    """Whether Python's own codecs read ``name`` (codecs.lookup is not used: a codec search
    function that a package registers may accept any name)."""
    import encodings

    return isinstance(name, str) and encodings.search_function(name.lower()) is not None
