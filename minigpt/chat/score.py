"""Exact-match scoring of a chat model on held-out conversations (greedy replies).

Each conversation's last message is the reference answer; the model answers the history before
it (``ChatTemplate.prompt_ids``), greedily, until ``<|end|>``; an item counts when the reply
equals the reference after stripping surrounding whitespace. A base model (no stored template)
is scored with a new template for its tokenizer: its special-token rows were never trained, so
it is the "before" number.

``python -m minigpt.chat.score CKPT FILE.jsonl [--out replies.jsonl] [--limit N]`` prints
``exact match: k/n = p`` and the count per task of ``minigpt.chat.synthetic``.
``generate.py chat=true``'s non-interactive mode is the user-facing path to the same replies.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from minigpt.chat.records import read_jsonl
from minigpt.chat.synthetic import task_of
from minigpt.chat.template import ChatTemplate
from minigpt.sampling import generate


@torch.no_grad()
def greedy_reply(model, template: ChatTemplate, messages: list[dict],
                 max_new_tokens: int = 32) -> str:
    """The model's greedy reply to ``messages`` (its text, without ``<|end|>``)."""
    prompt = template.prompt_ids(messages)[-model.config.context_length:]
    idx = torch.tensor([prompt], device=next(model.parameters()).device)
    out = generate(model, idx, max_new_tokens, temperature=0.0, eos_id=template.end_id,
                   vocab_size=template.min_vocab_size)[0, len(prompt):].tolist()
    if template.end_id in out:
        out = out[:out.index(template.end_id)]
    return template.decode(out)


def exact_match(model, template: ChatTemplate, conversations: list[list[dict]],
                max_new_tokens: int = 32) -> tuple[float, list[str]]:
    """``(fraction answered exactly, replies)`` over conversations ending in the reference."""
    replies = [greedy_reply(model, template, c[:-1], max_new_tokens) for c in conversations]
    hits = sum(r.strip() == c[-1]["content"].strip() for r, c in zip(replies, conversations, strict=True))
    return hits / max(1, len(conversations)), replies


def main(argv: list[str] | None = None) -> None:
    from minigpt.inference import load_for_inference

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", help="a training checkpoint (.ckpt)")
    parser.add_argument("data", help="a .jsonl of conversations ending in the reference reply")
    parser.add_argument("--out", help="write one {\"reply\": ...} line per conversation here")
    parser.add_argument("--limit", type=int, default=None, help="score the first N only")
    args = parser.parse_args(argv)
    loaded = load_for_inference(args.ckpt, device="cpu", dtype="float32")
    template = loaded.chat_template or ChatTemplate.for_tokenizer(loaded.tokenizer)
    conversations = [m for _, m in read_jsonl(args.data)][:args.limit]
    bad = [i for i, c in enumerate(conversations) if c[-1].get("role") != "assistant"]
    if bad:
        sys.exit(f"{args.data}: conversation {bad[0]} does not end in an assistant reply")
    score, replies = exact_match(loaded.model, template, conversations)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"reply": r}) + "\n" for r in replies)
    by_task: dict[str, list[bool]] = {}
    for reply, c in zip(replies, conversations, strict=True):
        task = task_of(c[-2]["content"]) if len(c) > 1 else None
        by_task.setdefault(task or "other", []).append(reply.strip() == c[-1]["content"].strip())
    hits = round(score * len(conversations))
    print(f"exact match: {hits}/{len(conversations)} = {score:.3f}"
          f"{' (no stored chat template: a base model)' if loaded.chat_template is None else ''}")
    for task, results in sorted(by_task.items()):
        print(f"  {task}: {sum(results)}/{len(results)}")


if __name__ == "__main__":
    main()
