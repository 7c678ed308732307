"""Decoding speed: new tokens/s of greedy generation, ours (KV cache, no cache, bf16 weights) vs
``transformers.GPT2LMHeadModel.generate(use_cache=True, do_sample=False)``.

    python bench/generate.py                        # GPT-2 small (124M), 2 threads, prints a table
    python bench/generate.py --threads 1 --repeats 7

Workload (issue 5): batch 1, a 16-token prompt, 256 new tokens, greedy, random GPT-2-small-sized
weights (vocab 50257), float32. Both models hold the same weights (ours is saved with
``minigpt.hf.save_hf_gpt2`` and loaded by ``transformers``), and the greedy tokens are compared.
All variants are built in this one process and timed round-robin after a warm-up, so machine
noise hits them alike; each variant's median over ``--repeats`` runs is reported. The no-cache
path reruns the whole sequence every token, so it gets fewer repeats (``--nocache-repeats``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from minigpt.model import GPT, GPTConfig  # noqa: E402
from minigpt.sampling import generate  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nocache-repeats", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--no-transformers", action="store_true", help="skip the HF baseline")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    model = GPT(GPTConfig()).eval()  # GPT-2 small: 12 layers, 768 dims, vocab 50257
    bf16 = GPT(GPTConfig()).eval()
    bf16.load_state_dict(model.state_dict())
    bf16.to(torch.bfloat16)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens),
                           generator=torch.Generator().manual_seed(0))
    n = args.new_tokens

    def ours(m, use_cache=True):
        return lambda: generate(m, prompt, n, temperature=0, use_cache=use_cache)

    variants = {  # name -> (run, repeats)
        "ours fp32, KV cache": (ours(model), args.repeats),
        "ours bf16 weights, KV cache": (ours(bf16), args.repeats),
        "ours fp32, no cache": (ours(model, use_cache=False), args.nocache_repeats),
    }
    if not args.no_transformers:
        hf = _transformers_model(model)

        def hf_generate():
            with torch.inference_mode():
                return hf.generate(prompt, attention_mask=torch.ones_like(prompt),
                                   max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                   use_cache=True, pad_token_id=0)

        variants["transformers fp32, use_cache=True"] = (hf_generate, args.repeats)

    outputs = {name: run() for name, (run, _) in variants.items()}  # warm-up, and the tokens
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(max(reps for _, reps in variants.values())):
        for name, (run, reps) in variants.items():
            if r < reps:
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)

    ref = outputs["ours fp32, KV cache"]
    rate = {name: n / statistics.median(ts) for name, ts in times.items()}
    print(f"\ngreedy decoding, batch 1, {args.prompt_tokens}-token prompt, {n} new tokens, "
          f"GPT-2 small random weights, torch {torch.__version__}, {args.threads} threads")
    print(f"{'variant':<36} {'new tok/s':>10} {'runs (s)':>28}  same tokens as ours fp32")
    for name, ts in times.items():
        same = "-" if name == "ours fp32, KV cache" else \
            ("yes" if torch.equal(outputs[name], ref) else
             f"first {_common_prefix(outputs[name], ref) - args.prompt_tokens} tokens")
        runs = " ".join(f"{t:.1f}" for t in ts)
        print(f"{name:<36} {rate[name]:>10.1f} {runs:>28}  {same}")
    cached = rate["ours fp32, KV cache"]
    print(f"\nours cached / ours no cache: {cached / rate['ours fp32, no cache']:.1f}x "
          "(target >= 5x)")
    if "transformers fp32, use_cache=True" in rate:
        base = rate["transformers fp32, use_cache=True"]
        print(f"ours fp32 cached / transformers fp32: {cached / base:.2f}x (target >= 1.2x)")
        print(f"ours bf16 cached / transformers fp32: "
              f"{rate['ours bf16 weights, KV cache'] / base:.2f}x (target >= 2x)")


def _transformers_model(model: GPT):
    """``transformers.GPT2LMHeadModel`` with ``model``'s weights (via a temporary HF directory)."""
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    from minigpt.hf import save_hf_gpt2

    hf_logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_gpt2(model, tmp)
        hf = GPT2LMHeadModel.from_pretrained(tmp, torch_dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # always produce all new tokens, as ours does
    return hf


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.shape != b.shape:
        n = min(a.shape[1], b.shape[1])
        a, b = a[:, :n], b[:, :n]
    diff = (a != b).nonzero()
    return int(diff[0, 1]) if len(diff) else a.shape[1]


if __name__ == "__main__":
    main()
