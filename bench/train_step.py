"""Training-step throughput: our GPT vs ``transformers.GPT2LMHeadModel`` (SDPA attention).

    python -m bench.train_step                       # toy and GPT-2 small, all cores
    python -m bench.train_step --sizes toy --repeats 10
    python -m bench.train_step --sizes toy --blocks modern --variants "ours bf16" "ours bf16 plain"

One step = the training loop's own step (``bench.loop_step``: forward + cross-entropy loss +
backward through Fabric, gradient clipping, ``AdamW(fused=True)`` with train.py's settings and
its schedule, zero_grad with set_to_none), dropout 0, train mode, the same configuration and batch
for every variant:

* ``ours fp32`` / ``HF fp32``: float32 throughout; our model as a CPU run of train.py trains it,
  with ``minigpt.cpu.speed_up_training`` applied (the chunked LM-head loss; with ``--blocks
  modern`` the compiled blocks too; glibc's process-wide setting left off, see ``build``);
* ``ours bf16``: the precision this CPU gets by default (AVX512-BF16 here): forward and loss under
  Fabric's ``bf16-mixed`` (``torch.autocast("cpu", dtype=torch.bfloat16)``), float32 master
  weights and optimizer, with ``speed_up_training`` applied as for ``bf16-mixed``;
* ``ours fp32 plain`` / ``ours bf16 plain``: our plain model (no ``minigpt.cpu``: eager blocks,
  ``F.cross_entropy`` over the full logits): the column "vs plain" is what the CPU speedups give.

``--blocks modern``: our model with the block options of ``recipe=blocks`` that run unfused
eagerly (RMSNorm, QK-norm, rotary positions, ReLU², an untied soft-capped head), which
``speed_up_training`` compiles; Hugging Face's rows are skipped there (GPT-2 blocks only).

Our model computes its loss with ``GPT.loss`` (its training API); Hugging Face's logits go
through the tests' plain cross-entropy (``tests.oracles.logits_cross_entropy``: cheaper than its
``labels=`` path, which copies shifted logits), so HF gets its best case. All variants live in
one process and are stepped interleaved (ours, HF, ours bf16, ours, ...) after warm-up; medians
of ``--repeats`` steps. Achieved FLOP/s counts ``GPT.flops_per_token`` (6 N + 12 L T C, N
without position embeddings) per token; MFU is against the float32 (or bfloat16) matmul peak
measured here with a large square matmul (the best of ``torch.mm`` and, in float32, oneDNN's).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.loop_step import CausalLMWithLoss, loop_step
from bench.timing import (
    add_timing_arguments,
    clock,
    configure_timing,
    median_ratios,
    print_header,
)
from minigpt.cpu import onednn, speed_up_training
from minigpt.model import GPT, GPTConfig

VARIANTS = ("ours fp32", "ours fp32 plain", "ours bf16", "ours bf16 plain", "HF fp32", "HF bf16")
MODERN = {"norm": "rmsnorm", "qk_norm": True, "position": "rope", "mlp": "relu2",
          "tie_head": False, "logit_softcap": 15.0}
VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 64, for both models
SIZES = {  # name -> (n_layer, n_head, n_embd, tokens, default batch)
    "toy": (6, 6, 384, 256, 8),
    "gpt2-small": (12, 12, 768, 256, 4),
}


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of an n x n x n matmul: the best of ``repeats`` after warm-up (the machine's
    reachable peak; other processes only ever lower a sample), taken over ``torch.mm`` and, in
    float32, oneDNN's linear op too (``minigpt.cpu.onednn``: on AMD CPUs MKL's ``torch.mm`` runs
    at about half of what the cores can do)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    kernels = [lambda: torch.mm(a, b, out=out)]
    if dtype == torch.float32 and onednn.available():
        packed = onednn.pack(b)
        kernels.append(lambda: onednn.linear(a, packed))
    best = float("inf")
    for kernel in kernels:
        for _ in range(3):
            kernel()
        for _ in range(repeats):
            start = clock()
            kernel()
            best = min(best, clock() - start)
    return 2 * n**3 / best


class Variant:
    """A model (anything with ``loss(x, y)``) and the training loop's own step on it
    (``bench.loop_step``: train.py's AdamW settings, clipping, the schedule)."""

    def __init__(self, name: str, model: torch.nn.Module, autocast: bool):
        self.name, self.autocast = name, autocast
        self.run_step = loop_step(model.train(), precision="bf16-mixed" if autocast else "32-true")
        self.times: list[float] = []
        self.losses: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        start = clock()
        loss = self.run_step(x, y)
        elapsed = clock() - start
        self.losses.append(loss.item())
        return elapsed


def build(size: str, variants: list[str], blocks: str = "gpt2") -> tuple[list[Variant], GPT]:
    import transformers

    n_layer, n_head, n_embd, T, _ = SIZES[size]
    config = GPTConfig(vocab_size=VOCAB, context_length=T, n_layer=n_layer, n_head=n_head,
                       n_embd=n_embd, dropout=0.0, **(MODERN if blocks == "modern" else {}))
    built = []
    reference = None
    for name in variants:
        torch.manual_seed(0)
        if name.startswith("ours"):
            model = GPT(config)
            reference = model
            bf16 = "bf16" in name
            if not name.endswith("plain"):
                # The chunked loss (and compiled blocks), in place (same Parameters). glibc's
                # keep-freed-memory setting stays off: it is process-wide, so Hugging Face's and
                # the plain model's steps would get it too.
                applied = speed_up_training(model, precision="bf16-mixed" if bf16 else "32-true",
                                            keep_freed_memory=False)
                print(f"{size} {name}: {'; '.join(applied)}")
            built.append(Variant(name, model, autocast=bf16))
        elif blocks == "gpt2":
            hf_config = transformers.GPT2Config(
                vocab_size=VOCAB, n_positions=T, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                attn_implementation="sdpa",
            )
            model = transformers.GPT2LMHeadModel(hf_config)
            assert model.config._attn_implementation == "sdpa"
            built.append(Variant(name, CausalLMWithLoss(model), autocast=name.endswith("bf16")))
    if reference is None:
        with torch.device("meta"):
            reference = GPT(config)
    return built, reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_arguments(parser, clock_note=": backward runs on the calling thread there")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--batch", type=int, help="batch size (default: 8 toy, 4 gpt2-small)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS,
                        default=["ours fp32", "HF fp32", "ours bf16", "ours fp32 plain",
                                 "ours bf16 plain"])
    parser.add_argument("--blocks", choices=("gpt2", "modern"), default="gpt2",
                        help="our model's blocks: GPT-2's, or the unfused options (see above)")
    args = parser.parse_args()
    configure_timing(parser, args)

    peak = {torch.float32: matmul_peak(torch.float32), torch.bfloat16: matmul_peak(torch.bfloat16)}
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.clock} clock")
    print(f"AdamW(fused=True), dropout 0, vocab {VOCAB}; median of {args.repeats} steps after "
          f"{args.warmup} warm-up, variants interleaved\n")
    header = (f"{'size':<11} {'B x T':>8} {'variant':<15} {'step s':>7} {'tokens/s':>9} "
              f"{'GFLOP/s':>8} {'MFU':>6} {'vs HF fp32':>10} {'vs plain':>8}")
    print_header(header)
    for size in args.sizes:
        n_layer, n_head, n_embd, T, default_batch = SIZES[size]
        B = args.batch or default_batch
        variants, reference = build(size, args.variants, args.blocks)
        generator = torch.Generator().manual_seed(0)
        data = torch.randint(0, VOCAB, (B, T + 1), generator=generator)
        x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        for i in range(args.warmup + args.repeats):
            for variant in variants:
                elapsed = variant.step(x, y)
                if i >= args.warmup:
                    variant.times.append(elapsed)
            for dtype in peak:  # re-measure the peak between rounds: keep the best seen
                peak[dtype] = max(peak[dtype], matmul_peak(dtype, repeats=1))
        flops_per_token = reference.flops_per_token(seq_len=T)
        times = {v.name: v.times for v in variants}
        medians = {name: statistics.median(t) for name, t in times.items()}
        vs_hf = median_ratios(times, "HF fp32") if "HF fp32" in times else {}
        for variant in variants:
            seconds = medians[variant.name]
            tokens_per_s = B * T / seconds
            flops = tokens_per_s * flops_per_token
            dtype = torch.bfloat16 if variant.autocast else torch.float32
            plain = f"{variant.name.removesuffix(' plain')} plain"
            vs_plain = median_ratios(times, plain).get(variant.name) if plain in times else None
            print(f"{size:<11} {f'{B}x{T}':>8} {variant.name:<15} {seconds:>7.2f} "
                  f"{tokens_per_s:>9.0f} {flops / 1e9:>8.1f} {flops / peak[dtype]:>6.1%} "
                  + (f"{vs_hf[variant.name]:>9.2f}x" if vs_hf else f"{'':>10}")
                  + (f" {vs_plain:>7.2f}x" if vs_plain is not None else ""))
        del variants
    print(f"\nmeasured matmul peak (best 2048^3 matmul seen during the run): float32 "
          f"{peak[torch.float32] / 1e9:.0f} GFLOP/s, bfloat16 {peak[torch.bfloat16] / 1e9:.0f} "
          "GFLOP/s")
    print("MFU = achieved FLOP/s / measured matmul peak of the variant's compute dtype "
          "(float32 or bfloat16)\nvs HF fp32, vs plain = median over rounds of HF fp32's (the plain "
          "model's of the same precision) step time / the variant's\n(steps of one round run back "
          "to back, so slow drifts in machine load cancel)")


if __name__ == "__main__":
    main()
