"""HellaSwag scoring speed: items/s of ``minigpt.eval`` against lm-eval's ``HFLM`` scoring the
same items (each ending after its context, ``loglikelihood``) on the same weights.

    python -m bench.eval --threads 1 --clock cpu   # GPT-2 small, 32 synthetic items; CPU time
    python -m bench.eval --items 200 --path hellaswag_val.jsonl   # real items, if you have them
    python -m bench.eval --device cuda --items 10042 --path hellaswag_val.jsonl --ours-only

Random GPT-2-small-sized weights (vocab 50257, float32; ours saved with ``GPT.save_pretrained``,
loaded by ``transformers.GPT2LMHeadModel`` for HFLM). Without ``--path`` the items are synthetic,
with HellaSwag's lengths (contexts of 20 to 90 tokens, endings of 10 to 35): HellaSwag's own file
needs a download. Both variants run in this one process, round-robin after a warm-up, and each
one's median over ``--repeats`` runs is reported; the log-likelihoods of the two are compared.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import torch

from bench.timing import add_timing_arguments, configure_timing, medians, time_interleaved
from minigpt.eval.hellaswag import Item, item_scores, read_items
from minigpt.model import GPT, GPTConfig
from minigpt.tokenizer import get_tokenizer


def synthetic_items(tokenizer, n: int, seed: int = 0) -> list[Item]:
    """``n`` items of word-like tokens, with contexts and endings as long as HellaSwag's."""
    words = [w for w in (tokenizer.decode([i]) for i in range(256, 20000))
             if w.startswith(" ") and w[1:].isalpha()]
    rng = random.Random(seed)

    def text(low, high):
        return "".join(rng.choices(words, k=rng.randint(low, high))).strip()

    return [Item(text(20, 90), tuple(text(10, 35) for _ in range(4)), rng.randrange(4))
            for _ in range(n)]


def hflm_for(model: GPT, directory: Path, batch_size: int, device: str):
    from lm_eval.models.huggingface import HFLM
    from transformers import GPT2LMHeadModel

    model.save_pretrained(str(directory))
    hf = GPT2LMHeadModel.from_pretrained(str(directory)).eval().to(device)
    return HFLM(pretrained=hf, tokenizer=gpt2_tokenizer(), batch_size=batch_size, device=device)


def gpt2_tokenizer():
    """GPT-2's tokenizer for transformers, from tiktoken's cached files (found by content)."""
    import os

    from transformers import GPT2TokenizerFast

    files = [f for f in Path(os.environ["TIKTOKEN_CACHE_DIR"]).iterdir() if f.is_file()]
    encoder = next(f for f in files if f.read_bytes()[:1] == b"{")
    merges = next(f for f in files if f.read_bytes()[:9] == b"#version:")
    lines = merges.read_text(encoding="utf-8").split("\n")[1:]
    return GPT2TokenizerFast(vocab=json.loads(encoder.read_text(encoding="utf-8")),
                             merges=[tuple(line.split()) for line in lines if line])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=32)
    parser.add_argument("--path", help="a HellaSwag jsonl file (default: synthetic items)")
    parser.add_argument("--batch-size", type=int, default=16, help="items per forward pass")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="autocast dtype of ours (HFLM runs float32)")
    parser.add_argument("--ours-only", action="store_true", help="skip HFLM (e.g. all items)")
    add_timing_arguments(parser, repeats=3)
    args = parser.parse_args()
    configure_timing(parser, args)
    torch.manual_seed(0)
    tokenizer = get_tokenizer("gpt2")
    items = read_items(args.path, args.items) if args.path else \
        synthetic_items(tokenizer, args.items)
    model = GPT(GPTConfig()).eval().to(args.device)  # GPT-2 small: 12 layers, 768 dims
    autocast = None
    if args.dtype != "float32":
        autocast = lambda: torch.autocast(args.device.split(":")[0], torch.bfloat16)  # noqa: E731
    requests = [(item.context, " " + ending) for item in items for ending in item.endings]
    tokens = sum(len(tokenizer.encode(c + e)) for c, e in requests)

    def ours():  # what python -m minigpt.eval runs
        scores, _ = item_scores(model, tokenizer, items, batch_size=args.batch_size,
                                device=args.device, autocast=autocast)
        return [s.logprob for four in scores for s in four]

    variants = {"minigpt.eval": ours}
    if not args.ours_only:
        from lm_eval.api.instance import Instance

        with tempfile.TemporaryDirectory() as tmp:
            lm = hflm_for(model, Path(tmp), 4 * args.batch_size, args.device)
        instances = [Instance("loglikelihood", {}, r, i) for i, r in enumerate(requests)]
        variants["lm-eval HFLM"] = lambda: [lp for lp, _ in lm.loglikelihood(
            instances, disable_tqdm=True)]

    results = {name: run() for name, run in variants.items()}  # warm-up, and the comparison
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else None
    times = medians(time_interleaved(variants, 0, args.repeats, sync=sync))

    print(f"{len(items)} items ({'file ' + args.path if args.path else 'synthetic'}), "
          f"{tokens} tokens in {len(requests)} context + ending rows, batch {args.batch_size} items, "
          f"{args.threads} threads, {args.clock} clock, {args.device}, ours {args.dtype}")
    print(f"{'variant':<14} {'median s':>9} {'items/s':>9}")
    for name, median in times.items():
        print(f"{name:<14} {median:>9.3f} {len(items) / median:>9.2f}")
    if len(variants) == 2:
        a, b = results["minigpt.eval"], results["lm-eval HFLM"]
        diff = max(abs(x - y) for x, y in zip(a, b, strict=True))
        ratio = times["lm-eval HFLM"] / times["minigpt.eval"]
        print(f"minigpt.eval / HFLM items per second: {ratio:.2f}x; "
              f"max |log-likelihood difference| {diff:.2e}")


if __name__ == "__main__":
    main()
