"""Decoding speed: new tokens/s of greedy generation, ours (KV cache, no cache, bf16 weights) vs
``transformers.GPT2LMHeadModel.generate(use_cache=True, do_sample=False)``.

    python -m bench.generate                  # GPT-2 small (124M), 1 thread, ~7 min, a table
    python -m bench.generate --threads 2 --repeats 7 --nocache-repeats 1

Workload (issue 5): batch 1, a 16-token prompt, 256 new tokens, greedy, random GPT-2-small-sized
weights (vocab 50257), float32. Both models hold the same weights (ours is saved with
``GPT.save_pretrained`` and loaded by ``transformers``), and the greedy tokens are compared.
All variants are built in this one process and timed round-robin after a warm-up, so machine
noise hits them alike; each variant's median over ``--repeats`` runs is reported. The no-cache
path reruns the whole sequence every token, so it gets fewer repeats (``--nocache-repeats``).
"packed" is what generate.py runs on the CPU: ``minigpt.cpu.speed_up_decoding`` (oneDNN-packed
linear weights; "bf16 weights" keeps float32 activations), "nn.Linear" the plain model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

from minigpt.cpu import onednn, speed_up_decoding
from minigpt.model import GPT, GPTConfig
from minigpt.sampling import generate

REF = "ours fp32, KV cache, packed"
HF = "transformers fp32, use_cache=True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: steadier when other work shares the cores)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nocache-repeats", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--no-transformers", action="store_true", help="skip the HF baseline")
    args = parser.parse_args()
    # speed_up_decoding packs nothing without oneDNN: the "packed" rows would be nn.Linear rows.
    if not onednn.available():
        sys.exit("oneDNN's linear op is not available in this PyTorch: nothing to pack")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    model = GPT(GPTConfig()).eval()  # GPT-2 small: 12 layers, 768 dims, vocab 50257

    def copy(dtype=None, weights=None):
        m = GPT(GPTConfig()).eval()
        m.load_state_dict(model.state_dict())
        if dtype is not None:
            m.to(dtype)
        if weights is not None:
            speed_up_decoding(m, weight_dtype=weights)  # in place
        return m

    packed = copy(weights=torch.float32)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens),
                           generator=torch.Generator().manual_seed(0))
    n = args.new_tokens

    def ours(m, use_cache=True):
        return lambda tokens=n: generate(m, prompt, tokens, temperature=0, use_cache=use_cache)

    variants = {  # name -> (run, repeats)
        REF: (ours(packed), args.repeats),
        "ours fp32, KV cache, nn.Linear": (ours(model), args.repeats),
        "ours fp32, no cache, packed": (ours(packed, use_cache=False), args.nocache_repeats),
        "ours bf16 weights, KV cache, packed": (ours(copy(weights=torch.bfloat16)), args.repeats),
        "ours bf16 model.to(), KV cache": (ours(copy(dtype=torch.bfloat16)), args.repeats),
    }
    if not args.no_transformers:
        hf = _transformers_model(model)

        def hf_generate(tokens=n):
            with torch.inference_mode():
                return hf.generate(prompt, attention_mask=torch.ones_like(prompt),
                                   max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                   use_cache=True, pad_token_id=0)

        variants[HF] = (hf_generate, args.repeats)

    for run, _ in variants.values():  # warm-up
        run(8)
    outputs, times, cpu = {}, {name: [] for name in variants}, {name: [] for name in variants}
    for r in range(max(reps for _, reps in variants.values())):
        for name, (run, reps) in variants.items():
            if r < reps:
                start, start_cpu = time.perf_counter(), time.process_time()
                outputs[name] = run()
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)

    ref = outputs[REF]
    # Wall time is what a user sees. On a shared machine a process also waits for the CPU; its
    # CPU time (summed over threads) does not count that wait, so with --threads 1 it measures
    # the code alone: "cpu tok/s" = new tokens per CPU second.
    rate = {name: n / statistics.median(ts) for name, ts in times.items()}
    cpu_rate = {name: n / statistics.median(ts) for name, ts in cpu.items()}
    print(f"\ngreedy decoding, batch 1, {args.prompt_tokens}-token prompt, {n} new tokens, "
          f"GPT-2 small random weights, torch {torch.__version__}, {args.threads} threads")
    print(f"{'variant':<38} {'new tok/s':>9} {'cpu tok/s':>9} {'runs (s)':>22}  "
          "same tokens as the first")
    for name, ts in times.items():
        same = "-" if name == REF else \
            ("yes" if torch.equal(outputs[name], ref) else
             f"first {_common_prefix(outputs[name], ref) - args.prompt_tokens} tokens")
        runs = " ".join(f"{t:.1f}" for t in ts)
        print(f"{name:<38} {rate[name]:>9.1f} {cpu_rate[name]:>9.1f} {runs:>22}  {same}")
    for label, r in (("wall", rate), ("cpu", cpu_rate)):
        print(f"\nratios ({label} time)")
        print(f"  ours fp32 cached / ours fp32 no cache: "
              f"{r[REF] / r['ours fp32, no cache, packed']:.1f}x (target >= 5x)")
        if HF in r:
            print(f"  ours fp32 cached / transformers fp32: {r[REF] / r[HF]:.2f}x (target >= 1.2x; "
                  f"{r['ours fp32, KV cache, nn.Linear'] / r[HF]:.2f}x unpacked)")
            print(f"  ours bf16 weights cached / transformers fp32: "
                  f"{r['ours bf16 weights, KV cache, packed'] / r[HF]:.2f}x (target >= 2x; "
                  f"{r['ours bf16 model.to(), KV cache'] / r[HF]:.2f}x with model.to(bfloat16))")


def _transformers_model(model: GPT):
    """``transformers.GPT2LMHeadModel`` with ``model``'s weights (via a temporary HF directory)."""
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
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
