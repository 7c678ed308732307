"""What ``train.py`` trains on ``data=chat`` (supervised fine-tuning): the tokenizer and chat
template, the model sized for them, and the conversations as rows (``ChatDataModule``).

The tokenizer and template come from where the weights do: a minigpt checkpoint in
``model.init_from`` brings its tokenizer (and its template, if it was fine-tuned before); a
Hugging Face GPT-2 directory GPT-2's BPE; a fresh model ``data.tokenizer`` (``char``: the
characters of the conversations). The template's special tokens must fit the model's rows: a
fresh model is sized for them, a pretrained one too small is grown (``init_model``'s
``min_vocab``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from minigpt.chat.datamodule import ChatDataModule, pack_split
from minigpt.chat.records import ChatDataError, read_hub, read_jsonl
from minigpt.chat.rows import train_on_all
from minigpt.chat.template import ChatFormatError, ChatTemplate, read_chat_template
from minigpt.checkpoint import METADATA_KEY, read_checkpoint
from minigpt.data.chat import ChatSettings
from minigpt.data.config import DataConfig
from minigpt.data.sources import expand_paths
from minigpt.tokenizer import CharTokenizer, Tokenizer, get_tokenizer, tokenizer_from_dict
from minigpt.train.model_init import init_model, padded_vocab_size

VAL_SEED = 0  # which conversations are held out does not change with the run's seed
SYNTHETIC_DIR = "data/chat_synth"  # configs/data/chat.yaml's files, written by minigpt.chat.synthetic


def _expanded(patterns: list[str]) -> list[str]:
    """``expand_paths``; a missing file of the synthetic set says how to write it."""
    try:
        return expand_paths(patterns)
    except FileNotFoundError as e:
        if any(SYNTHETIC_DIR in str(p) for p in patterns):
            raise FileNotFoundError(f"{e}; write the synthetic set with python -m "
                                    f"minigpt.chat.synthetic --out {SYNTHETIC_DIR}") from None
        raise


def read_conversations(config: DataConfig, settings: ChatSettings):
    """``(train, val)`` lists of ``(where, messages)``: ``data.paths`` or the hub dataset;
    validation from ``val_paths``, else a fixed ``val_fraction`` of them held out."""
    if config.paths:
        records = [r for path in _expanded(config.paths) for r in read_jsonl(path)]
    else:
        records = list(read_hub(config.hub_name, config.hub_config, config.split,
                                config.revision, config.cache_dir))
    records = records[:config.max_documents]
    if settings.val_paths:
        return records, [r for path in _expanded(settings.val_paths) for r in read_jsonl(path)]
    held = max(1, round(len(records) * config.val_fraction))
    if held >= len(records):
        raise ChatDataError(f"data={config.name}: {len(records)} conversation(s) are too few to "
                            f"hold out val_fraction={config.val_fraction}; add conversations or "
                            "give data.source_args.val_paths")
    val_index = set(np.random.default_rng(VAL_SEED).permutation(len(records))[:held].tolist())
    return ([r for i, r in enumerate(records) if i not in val_index],
            [r for i, r in enumerate(records) if i in val_index])


def chat_tokenizer(config: DataConfig, init_from: str | None, records
                   ) -> tuple[Tokenizer, ChatTemplate | None]:
    """The run's tokenizer, and the template ``init_from`` stored (None: a new one)."""
    if init_from:
        path = Path(init_from).expanduser()
        if path.is_dir():  # a Hugging Face GPT-2 directory
            return get_tokenizer("gpt2"), None
        meta = read_checkpoint(path)[METADATA_KEY]
        tokenizer = tokenizer_from_dict(meta["tokenizer"])
        return tokenizer, read_chat_template(meta, tokenizer)
    if config.tokenizer == "char":
        texts = (m.get("content") for _, messages in records for m in messages
                 if isinstance(m, dict))
        return CharTokenizer.from_text(t for t in texts if isinstance(t, str)), None
    return get_tokenizer(config.tokenizer), None


def render_all(template: ChatTemplate, records, train_on: str) -> list[tuple[list, list]]:
    """Each conversation's ``(ids, train_mask)``; a bad message names where it is."""
    rendered = []
    for where, messages in records:
        try:
            ids, mask = template.render(messages)
        except ChatFormatError as e:
            raise ChatDataError(f"{where}: {e}") from None
        rendered.append((ids, train_on_all(mask) if train_on == "all" else mask))
    return rendered


def chat_setup(train, fabric) -> tuple[dict, Tokenizer, object, ChatDataModule]:
    """``(meta, tokenizer, model, data)`` for ``minigpt.train.run.prepare``; prints one line
    per split saying how the conversations were packed."""
    config = DataConfig.from_any(train.data)
    settings = ChatSettings.from_args(config.source_args)
    train_records, val_records = read_conversations(config, settings)
    tokenizer, stored = chat_tokenizer(config, train.model.init_from,
                                       train_records + val_records)
    template = stored or ChatTemplate.for_tokenizer(tokenizer)
    vocab = padded_vocab_size(template.min_vocab_size, train.model.vocab_size)
    model = init_model(train.model, tokenizer, vocab, min_vocab=template.min_vocab_size)
    T = model.config.context_length
    splits, reports = {}, {}
    for split, records in (("train", train_records), ("val", val_records)):
        rendered = render_all(template, records, settings.train_on)
        splits[split], reports[split] = pack_split(rendered, config, settings, T,
                                                   template.bos_id, split)
        fabric.print(reports[split].describe(split, T + 1))
    data = ChatDataModule(config, template, splits["train"], splits["val"], seed=train.seed,
                          rank=fabric.global_rank, world_size=fabric.world_size)
    data.pin_memory = fabric.device.type == "cuda"
    data.document_bos = template.bos_id if model.config.document_mask else None
    meta = {"tokenizer": tokenizer.to_dict(), "vocab_size": model.config.vocab_size,
            "train_tokens": reports["train"].tokens}
    return meta, tokenizer, model, data
