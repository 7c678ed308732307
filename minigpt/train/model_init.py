"""The model a run starts from: a fresh ``GPT`` sized from the config and the tokenizer, or
weights from ``model.init_from`` (a Hugging Face GPT-2 directory or one of our checkpoints)."""

from __future__ import annotations

import math
from pathlib import Path

from lightning.fabric.utilities import rank_zero_info, rank_zero_warn

from minigpt.checkpoint import load_checkpoint
from minigpt.config.schema import ModelSchema
from minigpt.errors import ConfigError
from minigpt.model import GPT

VOCAB_MULTIPLE = 64  # pad the embedding/LM head to a multiple of 64 for faster matmuls


def padded_vocab_size(tokenizer_vocab: int, pinned: int | None) -> int:
    """The model's vocabulary: ``pinned`` if set (it must fit the tokenizer), else the
    tokenizer's rounded up to a multiple of 64."""
    if pinned is None:
        return math.ceil(tokenizer_vocab / VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if pinned < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size={pinned} is smaller than the tokenizer's vocabulary "
                          f"({tokenizer_vocab}); remove it to size the model from the data")
    return pinned


def init_model(model_cfg: ModelSchema | dict, tokenizer, vocab_size: int) -> GPT:
    """A fresh ``GPT``, or weights from ``model.init_from``: a Hugging Face GPT-2 directory
    (``GPT.from_pretrained``) or one of our ``.ckpt`` files. A pretrained source fixes the
    architecture; ``model.dropout`` (and, for GPT-2, a shorter ``model.context_length``) apply."""
    if isinstance(model_cfg, dict):  # a dict of its fields, for scripts
        model_cfg = ModelSchema(**model_cfg)
    source = model_cfg.init_from
    if not source:
        return GPT(model_cfg.gpt_config(vocab_size))
    path = Path(source).expanduser()
    if path.is_dir():
        model = GPT.from_pretrained(str(path), dropout=model_cfg.dropout,
                                    context_length=model_cfg.context_length)
        if tokenizer.name not in ("gpt2", "r50k_base"):
            rank_zero_warn(f"model.init_from={source} is GPT-2, but the data uses the "
                           f"{tokenizer.name!r} tokenizer: the pretrained embeddings will not fit")
    else:
        # model.dropout and model.context_length apply (a shorter context crops the position
        # table; a longer one than it holds is one line from the loader)
        model, ckpt_tokenizer, _ = load_checkpoint(path, dropout=model_cfg.dropout,
                                                   context_length=model_cfg.context_length)
        if ckpt_tokenizer.to_dict() != tokenizer.to_dict():
            raise ConfigError(f"model.init_from={source} was trained with tokenizer "
                              f"{ckpt_tokenizer.name!r}, the data uses {tokenizer.name!r}: "
                              "prepare the data with the checkpoint's tokenizer")
    if model.config.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.init_from={source} has vocab_size={model.config.vocab_size}, "
                          f"smaller than the tokenizer's {tokenizer.vocab_size}")
    rank_zero_info(f"initialized from {source}: {model.config}")
    model.train()
    return model
