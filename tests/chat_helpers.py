"""Shared pieces of the chat tests: a tiny model over a character vocabulary with its chat
template, and the oracle a cached conversation must match (greedy argmax over the whole conversation,
re-read every step by the uncached model)."""

from __future__ import annotations

from pathlib import Path

import torch

from minigpt.chat.template import ChatTemplate
from minigpt.checkpoint import checkpoint_metadata
from minigpt.model import GPT, GPTConfig
from minigpt.tokenizer import CharTokenizer

ROOT = Path(__file__).resolve().parents[1]
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 +=?.,\n"


def chat_template(tokenizer) -> ChatTemplate:
    return ChatTemplate.for_tokenizer(tokenizer)


def tiny_chat_model(context_length: int = 96, seed: int = 0, **options) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, context_length=context_length, n_layer=2, n_head=2,
                         n_embd=32, init_std=0.5, **options)).eval()


def char_tokenizer() -> CharTokenizer:
    return CharTokenizer(CHARS)


@torch.no_grad()
def reread_reply(model, ids: list[int], end_id: int, allowed: int, max_new_tokens: int):
    """The oracle: greedy tokens after ``ids`` until ``end_id`` (not returned) or
    ``max_new_tokens``, the model re-reading the whole sequence for every token (no cache).
    Only ids below ``allowed`` (the tokenizer's characters) and ``end_id`` are candidates."""
    ids, reply = list(ids), []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids]))[0, -1]  # (V,)
        candidates = torch.cat([logits[:allowed], logits[end_id:end_id + 1]])
        best = int(candidates.argmax())
        token = best if best < allowed else end_id
        if token == end_id:
            break
        reply.append(token)
        ids.append(token)
    return reply


def save_chat_checkpoint(path, model, tokenizer, template=None):
    """A checkpoint in the documented format, with the template a fine-tuned model stores."""
    meta = checkpoint_metadata(model.config.to_dict(), tokenizer.to_dict(),
                               None if template is None else template.to_dict())
    torch.save({"model": {"model." + k: v for k, v in model.state_dict().items()},
                "minigpt": meta, "global_step": 7}, path)
    return path
