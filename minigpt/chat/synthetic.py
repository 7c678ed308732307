"""A synthetic instruction set with exact answers, in the characters of the toy Shakespeare model.

``python -m minigpt.chat.synthetic --out data/chat_synth`` writes ``train.jsonl`` and
``val.jsonl`` (seeded; no held-out prompt is in training) of four tasks: reverse a word, add two
two-digit numbers (``worked_sum``), answer from a given sentence, name a word's first letter.
``--score replies.jsonl`` scores ``generate.py chat=true``'s ``chat_output`` per task instead
(docs/chat.md).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

LETTERS = "abcdefghijklmnopqrstuvwxyz"
NAMES = ("Anna", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gus", "Hal", "Ida", "Jon", "Kate", "Lear",
         "Mary", "Ned", "Olga", "Paul", "Rosa", "Sam", "Toby", "Viola")
COLORS = ("red", "blue", "green", "black", "white", "gold", "grey", "pink", "brown", "purple")
THINGS = ("hat", "cup", "box", "coat", "ring", "book", "shoe", "bag", "kite", "lamp", "sword",
          "cloak")


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 5)))


def reverse_task(rng: random.Random) -> tuple[str, str]:
    word = _word(rng)
    return f"Reverse the word: {word}", word[::-1]


def add_task(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"What is {a} plus {b}?", worked_sum(a, b)


def worked_sum(a: int, b: int) -> str:
    """The sum worked column by column, the carry said, the total last (docs/chat.md):
    ``worked_sum(46, 19) == "6 plus 9 is 15, 4 plus 1 plus 1 is 6, so 65"``."""
    units = a % 10 + b % 10
    carry = " plus 1" if units >= 10 else ""
    tens = a // 10 + b // 10 + units // 10
    return f"{a % 10} plus {b % 10} is {units}, {a // 10} plus {b // 10}{carry} is {tens}, " \
           f"so {a + b}"


def sentence_task(rng: random.Random) -> tuple[str, str]:
    name, color, thing = rng.choice(NAMES), rng.choice(COLORS), rng.choice(THINGS)
    return f"{name} has a {color} {thing}. What color is the {thing}?", color


def first_letter_task(rng: random.Random) -> tuple[str, str]:
    word = _word(rng)
    return f"What is the first letter of {word}?", word[0]


TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "reverse": reverse_task, "add": add_task, "sentence": sentence_task,
    "first_letter": first_letter_task}


def task_of(prompt: str) -> str | None:
    """The name of the task that wrote ``prompt`` (for per-task scores), or None."""
    if prompt.startswith("Reverse the word: "):
        return "reverse"
    if prompt.startswith("What is the first letter of "):
        return "first_letter"
    if prompt.startswith("What is ") and " plus " in prompt:
        return "add"
    if " What color is the " in prompt:
        return "sentence"
    return None


def make_items(n: int, seed: int, exclude: set[str] = frozenset()) -> list[tuple[str, str]]:
    """``n`` distinct (prompt, answer) items, the tasks taking turns, none with a prompt in
    ``exclude``. A draw that repeats a prompt is skipped, so a task with few prompts (2,400
    sentences) gives fewer items as it runs out."""
    rng = random.Random(seed)
    seen, items = set(exclude), []
    task_list = list(TASKS.values())
    for turn in range(100 * n):
        if len(items) == n:
            break
        prompt, answer = task_list[turn % len(task_list)](rng)
        if prompt not in seen:
            seen.add(prompt)
            items.append((prompt, answer))
    return items


def write_split(path: Path, items: list[tuple[str, str]]) -> None:
    lines = [json.dumps({"messages": [{"role": "user", "content": p},
                                      {"role": "assistant", "content": a}]}) for p, a in items]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def generate(out: str | Path, n_train: int = 8000, n_val: int = 400, seed: int = 0) -> dict:
    """Write ``train.jsonl`` and ``val.jsonl`` under ``out``; the held-out items first (so
    every task has its share of them), then the training items, disjoint from them."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    val = make_items(n_val, seed + 1)
    train = make_items(n_train, seed, exclude={p for p, _ in val})
    write_split(out / "val.jsonl", val)
    write_split(out / "train.jsonl", train)
    return {"train": len(train), "val": len(val), "out": str(out)}


def score_by_task(val_path: str | Path, replies_path: str | Path) -> dict[str, tuple[int, int]]:
    """``{task: (exact, items)}`` and ``all``, of ``generate.py chat=true``'s ``chat_output``
    (one ``{"reply", "reference"}`` line per conversation of ``val_path``, in order)."""
    from minigpt.chat.cli import exact_match

    val = [json.loads(line)["messages"] for line in Path(val_path).read_text().splitlines()]
    replies = [json.loads(line) for line in Path(replies_path).read_text().splitlines()]
    if len(val) != len(replies):
        raise ValueError(f"{replies_path} has {len(replies)} replies for the {len(val)} "
                         f"conversations of {val_path}")
    scores: dict[str, list[int]] = {}
    for messages, reply in zip(val, replies, strict=True):
        hit = int(exact_match(reply["reply"], messages[-1]["content"]))
        for task in (task_of(messages[0]["content"]) or "other", "all"):
            scores.setdefault(task, [0, 0])
            scores[task][0] += hit
            scores[task][1] += 1
    return {task: (hits, n) for task, (hits, n) in scores.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/chat_synth", help="output directory")
    parser.add_argument("--train", type=int, default=8000, help="training conversations")
    parser.add_argument("--val", type=int, default=400, help="held-out conversations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--score", metavar="REPLIES", help="score generate.py's chat_output "
                        "for <out>/val.jsonl per task instead of writing")
    args = parser.parse_args(argv)
    if args.score:
        for task, (hits, n) in sorted(score_by_task(Path(args.out) / "val.jsonl",
                                                    args.score).items()):
            print(f"{task}: {hits}/{n} = {hits / n:.3f}")
        return
    for name, value in (("--train", args.train), ("--val", args.val)):
        if value < 1:
            parser.error(f"{name}={value} must be at least 1")
    made = generate(args.out, args.train, args.val, args.seed)
    print(f"wrote {made['train']} training and {made['val']} held-out conversations to "
          f"{made['out']}/{{train,val}}.jsonl")


if __name__ == "__main__":
    main()
