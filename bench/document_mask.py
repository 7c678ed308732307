"""Document masking on the CPU: which kernel, and what it costs a toy training step.

    python -m bench.document_mask                          # all cores, wall clock
    python -m bench.document_mask --threads 1 --clock cpu  # one core, immune to other load
    python -m bench.document_mask --self-test              # tiny shapes, one repeat (CI)
    python -m bench.document_mask --device cuda --tokens 1024 --batch 8   # a GPU (unmeasured)

1. Kernels: forward + backward of one attention over (B, nh, T, hd) = the toy model's
   (32, 4, 256, 64) on packed rows of documents (lengths drawn around ``--doc-mean`` tokens):
   ``causal`` (SDPA, ``is_causal``: the cost to meet), ``dense mask`` (``document_attention``:
   SDPA with the boolean block-diagonal mask on the CPU, FlexAttention's block mask on CUDA), ``per document`` (one SDPA
   call per document of each row, causal), ``flex compiled`` (``torch.compile(flex_attention)``
   with the block mask; reported as failed where its CPU backward is missing).
2. The step: the toy model (4 layers, 4 heads, 256 dims, T = 256), forward + loss + backward +
   AdamW, as a CPU run of train.py steps it (``minigpt.cpu.speed_up_training``, bf16 autocast;
   ``--precision 32-true``), with ``document_mask`` off (causal SDPA) and on (document_ids of
   the same packed rows). The target: masked <= 1.15x causal.

Variants are timed interleaved after warm-up, in one process; medians of ``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from bench.timing import add_timing_arguments, clock, configure_timing, print_header
from minigpt.cpu import speed_up_training
from minigpt.documents import document_attention, document_ids_of, flex_document_attention
from minigpt.model import GPT, GPTConfig

TOY = dict(n_layer=4, n_head=4, n_embd=256, context_length=256, vocab_size=128, dropout=0.0)
BOS = 0


def packed_rows(batch: int, tokens: int, doc_mean: int, seed: int = 0) -> torch.Tensor:
    """(batch, tokens) token ids in 1..127 with BOS at each document start, document lengths
    drawn from an exponential law of mean ``doc_mean`` (at least 1 token)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(1, TOY["vocab_size"], (batch, tokens), generator=g)
    for row in idx:
        at = 0
        while at < tokens:
            row[at] = BOS
            at += 1 + int(torch.empty(1).exponential_(1 / doc_mean, generator=g).item())
    return idx


def per_document_attention(q, k, v, document_ids):
    """One causal SDPA call per document of each row (host-side lengths: a device sync)."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        _, counts = torch.unique_consecutive(document_ids[b], return_counts=True)
        start = 0
        for n in counts.tolist():
            s = slice(start, start + n)
            out[b, :, s] = F.scaled_dot_product_attention(q[b, :, s], k[b, :, s], v[b, :, s],
                                                          is_causal=True)
            start += n
    return out


def kernels(document_ids):
    sdpa = F.scaled_dot_product_attention
    return {
        "causal": lambda q, k, v: sdpa(q, k, v, is_causal=True),
        "dense mask": lambda q, k, v: document_attention(q, k, v, document_ids, None, None,
                                                         0.0, sdpa),
        "per document": lambda q, k, v: per_document_attention(q, k, v, document_ids),
        "flex compiled": lambda q, k, v: flex_document_attention(q, k, v, document_ids, None,
                                                                 None, compiled=True),
    }


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_interleaved(steps: dict, repeats: int, warmup: int = 2) -> dict[str, float | str]:
    """Median seconds per call of each step (its error's first line if it fails in warm-up)."""
    results: dict[str, float | str] = {}
    live = {}
    for name, step in steps.items():
        try:
            for _ in range(warmup):
                step()
            live[name] = step
        except Exception as e:  # noqa: BLE001 - a kernel this build lacks is a result
            results[name] = f"failed: {str(e).splitlines()[0][:80]}"
    times = {name: [] for name in live}
    for _ in range(repeats):
        for name, step in live.items():
            _sync()
            start = clock()
            step()
            _sync()
            times[name].append(clock() - start)
    results.update({name: statistics.median(t) for name, t in times.items()})
    return results


def kernel_table(idx: torch.Tensor, repeats: int) -> None:
    B, T = idx.shape
    nh, hd = TOY["n_head"], TOY["n_embd"] // TOY["n_head"]
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, nh, T, hd, device=idx.device, requires_grad=True)
               for _ in range(3))

    def fwd_bwd(kernel):
        def step():
            kernel(q, k, v).sum().backward()
        return step

    steps = {name: fwd_bwd(kernel) for name, kernel in kernels(document_ids_of(idx, BOS)).items()}
    results = time_interleaved(steps, repeats)
    print_header(f"{'kernel (fwd+bwd)':<16} {'ms':>9} {'vs causal':>10}")
    for name, result in results.items():
        if isinstance(result, str):
            print(f"{name:<16} {result}")
        else:
            print(f"{name:<16} {result * 1e3:9.2f} {result / results['causal']:9.2f}x")


def step_table(idx: torch.Tensor, repeats: int, precision: str) -> None:
    x, y = idx, torch.roll(idx, -1, dims=1)
    ids = document_ids_of(idx, BOS)
    steps = {}
    for name, masked in (("causal", False), ("document_mask", True)):
        torch.manual_seed(0)
        config = GPTConfig(**{**TOY, "context_length": idx.shape[1]}, document_mask=masked)
        model = GPT(config).to(idx.device).train()
        speed_up_training(model, precision=precision, keep_freed_memory=False)  # CPU only
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step(model=model, optimizer=optimizer, masked=masked):
            with torch.autocast(x.device.type, dtype=torch.bfloat16,
                                enabled=precision == "bf16-mixed"):
                loss = model.loss(x, y, document_ids=ids if masked else None)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        steps[name] = step
    results = time_interleaved(steps, repeats)
    B, T = idx.shape
    print_header(f"{'toy step':<16} {'ms':>9} {'tokens/s':>10} {'vs causal':>10}")
    for name, seconds in results.items():
        print(f"{name:<16} {seconds * 1e3:9.1f} {B * T / seconds:10,.0f} "
              f"{seconds / results['causal']:9.2f}x")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--doc-mean", type=int, default=64, help="mean document length")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--precision", choices=("bf16-mixed", "32-true"), default="bf16-mixed")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--self-test", action="store_true", help="tiny shapes, one repeat")
    add_timing_arguments(parser)
    args = parser.parse_args(argv)
    configure_timing(parser, args)
    if args.self_test:
        args.batch, args.tokens, args.doc_mean, args.repeats = 2, 32, 8, 1
    idx = packed_rows(args.batch, args.tokens, args.doc_mean).to(args.device)
    docs = int((idx == BOS).sum())
    print(f"{args.batch} rows x {args.tokens} tokens, {docs} documents "
          f"(mean {idx.numel() / docs:.0f} tokens), {torch.get_num_threads()} thread(s), "
          f"{args.clock} clock, torch {torch.__version__}\n")
    kernel_table(idx, args.repeats)
    print()
    step_table(idx, args.repeats, args.precision)


if __name__ == "__main__":
    main()
