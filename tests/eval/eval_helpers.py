"""Shared pieces of the evaluation tests: a tiny GPT-2-vocabulary model, a HellaSwag-format file,
and the Hugging Face side of the oracles (GPT2LMHeadModel on the same weights, GPT-2's tokenizer
built from tiktoken's cached files)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from minigpt.model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[2]

CONTEXTS = [
    "A man is standing on a ladder next to a house. He",
    "The woman pours flour into a large bowl and",
    "Two children are playing with a red ball in the park. One of them",
    "A chef slices an onion on a wooden board, then",
    "[header] How to clean a cast iron pan [title] Rinse the pan with hot water.",
    "A dog runs across the beach toward the water and",
    "The band walks onto the stage while the crowd cheers. The singer",
    "A girl ties her shoes and picks up her backpack. She",
    "Someone is painting a fence white with a wide brush. They",
    "A man in a suit opens a laptop at the airport and",
    "The cyclist climbs the steep hill slowly, then",
    "A woman is knitting a scarf on the couch while the cat",
]
ENDINGS = [
    "paints the window frame carefully.",
    "then stops to drink a glass of water.",
    "jumps into the lake with all of his clothes on and swims away quickly.",
    "laughs.",
    "looks at the camera and keeps talking about the weather for a long time.",
    "puts it down.",
]


def write_items(path: Path, n: int = len(CONTEXTS), seed: int = 0) -> list[dict]:
    """Write ``n`` HellaSwag-format items to ``path`` (one with ``ctx_a``/``ctx_b`` and a string
    label, as the hub dataset has them); return the records."""
    g = torch.Generator().manual_seed(seed)
    records = []
    for i in range(n):
        pick = torch.randperm(len(ENDINGS), generator=g)[:4].tolist()
        record = {"ctx": CONTEXTS[i % len(CONTEXTS)], "endings": [ENDINGS[k] for k in pick],
                  "label": int(torch.randint(4, (), generator=g)), "activity_label": "Test"}
        if i == 1:
            a, b = record.pop("ctx").split(" and")
            record.update(ctx_a=a, ctx_b="and" + b, label=str(record["label"]))
        records.append(record)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def tiny_model(context_length: int = 64, seed: int = 0) -> GPT:
    """2 layers, 2 heads, 32 dims over GPT-2's vocabulary; weights large enough that the
    endings' scores differ by more than rounding."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=50257, context_length=context_length, n_layer=2, n_head=2,
                         n_embd=32, init_std=0.3)).eval()


def hf_model(model: GPT, directory: Path):
    """``transformers.GPT2LMHeadModel`` on ``model``'s weights, through ``save_pretrained``."""
    from transformers import GPT2LMHeadModel

    model.save_pretrained(str(directory))
    return GPT2LMHeadModel.from_pretrained(str(directory)).eval()


def gpt2_tokenizer():
    """GPT-2's tokenizer for transformers, from tiktoken's cached files (found by content)."""
    from transformers import GPT2TokenizerFast

    cache = Path(os.environ["TIKTOKEN_CACHE_DIR"])
    encoder = merges = None
    for f in cache.iterdir():
        if f.is_file():
            head = f.read_bytes()[:16]
            if head.startswith(b"{"):
                encoder = f
            elif head.startswith(b"#version:"):
                merges = f
    assert encoder is not None and merges is not None, f"no GPT-2 files in {cache}"
    lines = merges.read_text(encoding="utf-8").split("\n")[1:]
    return GPT2TokenizerFast(vocab=json.loads(encoder.read_text(encoding="utf-8")),
                             merges=[tuple(line.split()) for line in lines if line])


def eval_config(*overrides):
    """``configs/eval.yaml`` composed with ``overrides``, on the CPU without a progress bar."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("eval", overrides=["progress=false", "device=cpu", *overrides])
