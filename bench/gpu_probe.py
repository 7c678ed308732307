"""Where the GPU time goes: decode-step times by batch size, training steps by micro-batch, and a
``torch.profiler`` table of each (CUDA only).

    python -m bench.gpu_probe                       # GPT-2 small shapes
    python -m bench.gpu_probe --out prof/           # also write the profiler tables there

``bench/gpu.py`` answers "how fast, against transformers"; this answers "why": a decode step that
grows with the batch or the cache (a copy per step), a training step that is not mostly matmuls.
Decode steps are timed as 100 replays of ``StaticDecoder.step`` (a CUDA graph each) from an
empty cache, training steps as ``bench/gpu.py`` steps them; medians.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from bench import gpu
from bench.timing import medians, time_interleaved
from minigpt.model import GPT
from minigpt.sampling import generate
from minigpt.static_decoding import StaticDecoder


def median_ms(run, repeats: int = 5) -> float:
    times = time_interleaved({"run": run}, 0, repeats, sync=torch.cuda.synchronize)
    return 1e3 * medians(times)["run"]


def profile_table(run, rows: int = 25) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows,
                                     max_name_column_width=70)


def decode_steps(plan: gpu.Plan, batches, out: Path | None) -> None:
    """Milliseconds per replayed decode step, bf16 weights, cache of ``context_length`` slots."""
    model = GPT(plan.config).eval().to("cuda", torch.bfloat16)
    with torch.inference_mode():
        for batch in batches:
            decoder = StaticDecoder(model, batch, compile=True)
            prompt = torch.randint(0, plan.config.vocab_size, (batch, 16), device="cuda")
            generate(model, prompt, 8, temperature=0, decoder=decoder)  # compile and capture
            token = prompt[:, :1].clone()
            steps = min(100, decoder.cache.capacity)

            def run(decoder=decoder, token=token, steps=steps):
                decoder.cache.reset()  # an empty cache: room for `steps` tokens
                for _ in range(steps):
                    decoder.step(token)

            ms = median_ms(run) / steps
            print(f"decode step, batch {batch:>3}: {ms:.3f} ms", flush=True)
            if out is not None:
                table = profile_table(run)
                (out / f"decode_b{batch}.txt").write_text(table)


def train_steps(plan: gpu.Plan, batches, out: Path | None) -> None:
    """Milliseconds, tokens/s and MFU of a training step at each micro-batch."""
    T, V = plan.config.context_length, plan.config.vocab_size
    for batch in batches:
        torch._dynamo.reset()
        model = GPT(plan.config).to("cuda").train()
        step = gpu._train_step(model, plan)
        x, y = torch.randint(0, V, (2, batch, T), device="cuda")
        def run(step=step, x=x, y=y):
            step(x, y)

        for _ in range(plan.warmup):
            run()
        ms = median_ms(run, repeats=plan.repeats)
        tokens_per_s = batch * T / ms * 1e3
        peak = gpu.peak_flops(plan.device, torch.bfloat16)
        mfu = f"{gpu._flops_per_token(plan.config) * tokens_per_s / peak:.1%}" if peak else "n/a"
        print(f"training step, batch {batch:>3}: {ms:.1f} ms, {tokens_per_s:,.0f} tokens/s, "
              f"MFU {mfu}", flush=True)
        if out is not None:
            (out / f"train_b{batch}.txt").write_text(profile_table(run))
        del model, step
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--train-batches", type=int, nargs="+", default=[12, 24])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, help="a folder for the profiler tables")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gpu_probe needs a CUDA GPU (python -m bench.gpu --self-test runs on the CPU)")
        return 2
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    torch.set_float32_matmul_precision("high")  # as train.py
    plan = gpu.gpu_plan(argparse.Namespace(batch=12, repeats=args.repeats, new_tokens=8))
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    decode_steps(plan, args.decode_batches, args.out)
    train_steps(plan, args.train_batches, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
