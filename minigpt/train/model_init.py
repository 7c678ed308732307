"""The model a run starts from: a fresh ``GPT`` sized from the config and the tokenizer, or
weights from ``model.init_from`` (a Hugging Face GPT-2 directory or one of our checkpoints)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from lightning.fabric.utilities import rank_zero_info, rank_zero_warn

from minigpt.checkpoint import load_checkpoint
from minigpt.config.schema import ModelSchema
from minigpt.errors import ConfigError
from minigpt.model import GPT, GPTConfig

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


def init_model(model_cfg: ModelSchema | dict, tokenizer, vocab_size: int,
               min_vocab: int | None = None) -> GPT:
    """A fresh ``GPT``, or weights from ``model.init_from`` (a Hugging Face GPT-2 directory or
    one of our ``.ckpt`` files: the architecture fixed, ``model.dropout`` and a shorter
    ``model.context_length`` applied). ``min_vocab``: the rows the run's ids need (a chat
    template's special tokens); a pretrained model with fewer is grown (``grow_vocab``)."""
    if isinstance(model_cfg, dict):  # a dict of its fields, for scripts
        model_cfg = ModelSchema(**model_cfg)
    source = model_cfg.init_from
    if not source:
        return GPT(model_cfg.gpt_config(vocab_size))
    path = Path(source).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        inside = [p for p in (path / "last.ckpt", path / "checkpoints" / "last.ckpt")
                  if p.is_file()]
        raise ConfigError(f"model.init_from={source} is a directory without config.json: give a "
                          "Hugging Face GPT-2 directory (config.json + model.safetensors) or a "
                          f".ckpt file{f', e.g. model.init_from={inside[0]}' if inside else ''}")
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
    if min_vocab is not None and model.config.vocab_size < min_vocab:
        rows = model.config.vocab_size
        model = grow_vocab(model, padded_vocab_size(min_vocab, None))
        rank_zero_info(f"grew the embedding{'' if model.config.tie_head else ' and the LM head'} "
                       f"of {source} from {rows} to {model.config.vocab_size} rows for the chat "
                       "template's special tokens (new rows: the mean of the pretrained ones)")
    rank_zero_info(f"initialized from {source}: {model.config}")
    model.train()
    return model


@torch.no_grad()
def grow_vocab(model: GPT, vocab_size: int) -> GPT:
    """A copy of ``model`` with ``vocab_size`` rows in every per-token table (embeddings, an
    untied LM head); each new row is the mean of its table's old rows (an average token)."""
    old_rows = model.config.vocab_size
    grown = GPT(GPTConfig.from_dict({**model.config.to_dict(), "vocab_size": vocab_size}))
    target = grown.state_dict()
    state = {}
    for name, tensor in model.state_dict().items():
        if tensor.shape != target[name].shape:  # (old_rows, ...) -> (vocab_size, ...)
            assert tensor.shape[0] == old_rows and target[name].shape[1:] == tensor.shape[1:]
            mean = tensor.mean(dim=0, keepdim=True).expand(vocab_size - old_rows, *tensor.shape[1:])
            tensor = torch.cat([tensor, mean])
        state[name] = tensor
    grown.load_state_dict(state)
    return grown.train(model.training)
