"""Decoding speed against the memory bound: new tokens/s of greedy generation, ours (every
decoder) vs ``transformers.GPT2LMHeadModel.generate``, and as a fraction of the bound.

    python -m bench.generate                  # GPT-2 small (124M), 1 thread, a few minutes
    python -m bench.generate --threads 2 --repeats 7 --compiled

Workload: batch 1, a 16-token prompt, ``--new-tokens`` new tokens, greedy, random
GPT-2-small-sized weights (vocab 50257). Both models hold the same weights (ours is saved with
``GPT.save_pretrained`` and loaded by ``transformers``), and the greedy tokens are compared.

**The bound**: decoding a token multiplies one vector by every weight matrix (the blocks' linear
layers and the LM head), so no decoder can be faster than one pass over those weights. It is
timed as that pass, two ways, each timed like the decoders (the rows "bound ... pass"), and the
bound is the faster: each matrix, contiguous, multiplied by one vector with the fastest of three
eager kernels (``F.linear``, an (in, out) copy on MKL, oneDNN's packed layout where this CPU
runs it), in the model's order so every weight comes from memory as it does when decoding; and with ``--compiled`` the compiled decoders' own row-sum weights in one compiled
call (how fast a pass reads depends on where its weights lie in memory). The bfloat16 rows are
held against the same passes over bfloat16 weights.

Rows: "packed" is what generate.py runs on the CPU (``minigpt.cpu.speed_up_decoding``:
oneDNN-packed weights, by rule); "nn.Linear" the plain model; "fixed-shape" the decoder CUDA
graphs use (``minigpt.static_decoding``, over the packed model, eager here: it attends over its whole
cache, sized to prompt + new tokens), "compiled" what ``generate.py decoder=compiled`` runs on
the CPU (``--compiled``: that step compiled by inductor over row-sum weights, float32 and, with
bfloat16, bfloat16 ones; compile times printed apart); "no cache" reruns the window every token
(fewer repeats); "bf16 weights" keep float32 activations in every row. All variants live in
this process and are timed round-robin after a warm-up; medians over ``--repeats``. Then per
weight shape: each layout's one-row product, and with ``--compiled`` a prompt's rows by the
row-sum weights (each product, and the one its rule applied). Wall rates are what a user sees;
with ``--threads 1`` the CPU-time rates are not inflated by other processes on a shared machine
(``--clock cpu`` times the per-shape tables by CPU time too).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from bench.timing import add_timing_arguments, clock, configure_timing
from minigpt.cpu import onednn, speed_up_decoding
from minigpt.cpu.packed import PROMPT_PRODUCTS, ROWSUM, PackedLinear, matmul_packed
from minigpt.model import GPT, GPTConfig
from minigpt.sampling import generate
from minigpt.static_decoding import StaticDecoder, cpu_step_options

REF = "ours fp32, KV cache, packed"
PLAIN = "ours fp32, KV cache, nn.Linear"
NOCACHE = "ours fp32, no cache, packed"
BF16 = "ours bf16 weights, KV cache, packed"
HF = "transformers fp32, use_cache=True"
BOUND = "bound fp32 (one pass over the weights)"  # the faster of its two passes below
BOUND_BF16 = "bound bf16 weights (one pass)"
PASSES = {BOUND: ("bound fp32, eager pass", "bound fp32, compiled row-sum pass"),
          BOUND_BF16: ("bound bf16, eager pass", "bound bf16, compiled row-sum pass")}
COMPILED = "ours fp32, fixed-shape cache, compiled"
COMPILED_BF16 = "ours bf16, fixed-shape cache, compiled"
BF16_REFERENCE = "float32 on bf16-rounded weights"  # not timed: the bf16 rows' tokens


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    configure_timing(parser, args)
    if not onednn.available():
        sys.exit("oneDNN's linear op is not available in this PyTorch: nothing to pack")
    torch.manual_seed(0)
    model = GPT(GPTConfig()).eval()  # GPT-2 small: 12 layers, 768 dims, vocab 50257
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens),
                           generator=torch.Generator().manual_seed(0))
    variants, layouts, rowsum = build_variants(model, prompt, args)
    times, cpu, outputs = run_interleaved(variants)
    if args.dtype != "float32":
        outputs[BF16_REFERENCE] = bf16_reference(model, prompt, args.new_tokens)
    report(times, cpu, outputs, args)
    report_shapes(layouts, args)
    report_prompt_products(rowsum, args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_arguments(parser)
    parser.set_defaults(threads=1)  # steadier when other work shares the cores
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nocache-repeats", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=("both", "float32", "bfloat16"), default="both",
                        help="weights of our rows: float32, bfloat16 (float32 activations) or both")
    parser.add_argument("--compiled", action="store_true",
                        help="also the fixed-shape decoder under torch.compile (compiles first)")
    parser.add_argument("--no-transformers", action="store_true", help="skip the HF baseline")
    return parser


def build_variants(model: GPT, prompt: torch.Tensor, args) -> tuple[dict, dict, dict]:
    """name -> (run(tokens) -> token ids or None, repeats); per float32 weight shape, the
    bound's trial timings of each layout and the layout the packed model uses; and the compiled
    decoders' models by weight dtype (None where not built)."""
    n = args.new_tokens

    def copy(weights=None, traceable=False):
        m = GPT(GPTConfig()).eval()
        m.load_state_dict(model.state_dict())
        if weights is not None:
            applied = speed_up_decoding(m, weight_dtype=weights, traceable=traceable)  # in place
            print(f"speed_up_decoding({weights}{', traceable' if traceable else ''}): "
                  f"{', '.join(applied)}", file=sys.stderr)
        return m

    def ours(m, use_cache=True, decoder=None):
        return lambda tokens=n: generate(m, prompt, tokens, temperature=0, use_cache=use_cache,
                                         decoder=decoder)

    # The compiled decoders' models, built first: their bound pass reads their own weights (how
    # fast a pass reads depends on where the weights lie in memory, by up to ~1.4x here).
    wanted = {"float32": (torch.float32,), "bfloat16": (torch.bfloat16,),
              "both": (torch.float32, torch.bfloat16)}[args.dtype]
    rowsum = {dtype: copy(dtype, traceable=True) if args.compiled and dtype in wanted else None
              for dtype in (torch.float32, torch.bfloat16)}
    passes, shape_seconds = weight_pass(model, torch.float32, n, rowsum[torch.float32])
    variants = {name: (run, args.repeats) for name, run in zip(PASSES[BOUND], passes, strict=False)}
    layouts = {}
    capacity = args.prompt_tokens + n  # sized to the generation, as generate.py does
    if args.dtype != "bfloat16":
        packed, plain = copy(torch.float32), copy()
        for m in packed.modules():
            if isinstance(m, (torch.nn.Linear, PackedLinear)):
                kernel = {"onednn": "oneDNN"}.get(getattr(m, "kernel", None), "nn.Linear")
                layouts[(m.in_features, m.out_features)] = kernel
        layouts = {shape: (shape_seconds[shape], kernel) for shape, kernel in layouts.items()}
        variants[REF] = (ours(packed), args.repeats)
        variants[PLAIN] = (ours(plain), args.repeats)
        variants["ours fp32, fixed-shape cache, eager"] = (
            ours(packed, decoder=StaticDecoder(packed, 1, capacity=capacity)), args.repeats)
        if args.compiled:
            variants[COMPILED] = (compiled_decoding(rowsum[torch.float32], ours, capacity),
                                  args.repeats)
        variants[NOCACHE] = (ours(packed, use_cache=False), args.nocache_repeats)
    if args.dtype != "float32":
        passes = weight_pass(model, torch.bfloat16, n, rowsum[torch.bfloat16])[0]
        variants.update({name: (run, args.repeats) for name, run in zip(PASSES[BOUND_BF16],
                                                                         passes, strict=False)})
        variants[BF16] = (ours(copy(torch.bfloat16)), args.repeats)
        if args.compiled:  # decoder=compiled dtype=bfloat16: row-sum bf16 weights
            variants[COMPILED_BF16] = (compiled_decoding(rowsum[torch.bfloat16], ours, capacity),
                                       args.repeats)
    if not args.no_transformers:
        hf = _transformers_model(model)

        def hf_generate(tokens=n):
            with torch.inference_mode():
                return hf.generate(prompt, attention_mask=torch.ones_like(prompt),
                                   max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                   use_cache=True, pad_token_id=0)

        variants[HF] = (hf_generate, args.repeats)
    return variants, layouts, rowsum


@torch.no_grad()
def bf16_reference(model: GPT, prompt: torch.Tensor, tokens: int) -> torch.Tensor:
    """The greedy tokens of the plain float32 model on ``model``'s linear weights rounded to
    bfloat16: what a decoder on bfloat16 weights and float32 activations should produce."""
    rounded = GPT(GPTConfig()).eval()
    rounded.load_state_dict(model.state_dict())
    for layer in rounded.modules():
        if isinstance(layer, torch.nn.Linear):
            layer.weight.copy_(layer.weight.to(torch.bfloat16).float())
    return generate(rounded, prompt, tokens, temperature=0)


def compiled_decoding(model: GPT, ours, capacity: int):
    """generate.py's ``decoder=compiled`` on the CPU: the step over a fixed-shape cache of
    ``capacity`` slots, compiled by inductor (compiled here, timed apart and printed)."""
    start, start_cpu = time.perf_counter(), time.process_time()
    run = ours(model, decoder=StaticDecoder(model, 1, compile=True, capacity=capacity))
    run(2)  # the first step compiles
    print(f"compile time of the fixed-shape step: {time.perf_counter() - start:.1f} s wall, "
          f"{time.process_time() - start_cpu:.1f} s CPU (not in the rates below)", file=sys.stderr)
    return run


@torch.no_grad()
def weight_pass(model: GPT, dtype: torch.dtype, tokens: int, rowsum_model: GPT | None = None):
    """Calls ``run(passes=tokens)`` that multiply one vector by every weight matrix a decoded
    token multiplies by: eagerly in the model's order, each matrix with the kernel of
    ``eager_kernels`` that read it fastest in three trial passes; and given ``rowsum_model`` (``speed_up_decoding(traceable=True)`` in ``dtype``) also a
    pass over its row-sum weights compiled by inductor into one call (what ``decoder=compiled``
    reads). Also the seconds per product of each layout per (in, out) shape (eager: the mean
    over the shape's matrices of each one's fastest trial pass; row-sum: float32 only, the
    per-shape table's)."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    kernels = eager_kernels(dtype)
    layouts = {k: [lay_out(m.weight) for m in linears] for k, (lay_out, _) in kernels.items()}
    vectors = {m.in_features: torch.ones(1, m.in_features, dtype=dtype) for m in linears}
    trials = {kernel: [float("inf")] * len(linears) for kernel in kernels}
    for _ in range(4):  # the first pass warms up
        for kernel, (_, multiply) in kernels.items():
            for i, (m, w) in enumerate(zip(linears, layouts[kernel], strict=True)):
                start = clock()
                multiply(vectors[m.in_features], w)
                trials[kernel][i] = min(trials[kernel][i], clock() - start)
    chosen = []
    shapes: dict[tuple[int, int], dict[str, list[float]]] = {}
    for i, m in enumerate(linears):
        kernel = min(kernels, key=lambda k: trials[k][i])
        chosen.append((vectors[m.in_features], layouts[kernel][i], kernels[kernel][1]))
        for k in kernels:
            shapes.setdefault((m.in_features, m.out_features), {}).setdefault(k, []).append(
                trials[k][i])
    shape_seconds = {shape: {k: statistics.mean(t) for k, t in by_kernel.items()}
                     for shape, by_kernel in shapes.items()}

    def eager(passes=tokens):
        for _ in range(passes):
            for x, w, multiply in chosen:
                multiply(x, w)

    if rowsum_model is None:
        return [eager], shape_seconds
    weights = [m._packed for m in rowsum_model.modules() if isinstance(m, PackedLinear)]
    vectors = [torch.ones(1, m.in_features) for m in linears]
    if dtype == torch.float32:  # the per-shape table's column
        calls = {shape: (_compiled_products(), [vectors[i] for i in idx],
                         [weights[i] for i in idx]) for shape, idx in _by_shape(linears).items()}
        best = dict.fromkeys(calls, float("inf"))
        for _ in range(4):  # shapes in turn, so each comes from memory; the first call compiles
            for shape, (call, xs, ws) in calls.items():
                best[shape] = min(best[shape], _seconds(call, xs, ws))
        for shape, (_, xs, _) in calls.items():
            shape_seconds[shape][ROWSUM] = best[shape] / len(xs)
    whole = _compiled_products()
    whole(vectors, weights)  # compiles

    @torch.no_grad()
    def rowsum(passes=tokens):  # the graph was compiled without gradients
        for _ in range(passes):
            whole(vectors, weights)

    return [eager, rowsum], shape_seconds


def eager_kernels(dtype: torch.dtype) -> dict:
    """name -> (lay out a weight, multiply a row by it) of the eager one-row products the bound
    takes the fastest of, in ``dtype``: ``F.linear`` on the (out, in) weight, MKL's GEMM on an
    (in, out) copy, and oneDNN's packed layout where this CPU runs it in ``dtype``."""
    kernels = {"nn.Linear": (lambda w: w.detach().to(dtype), F.linear),
               "(in, out)": (lambda w: w.detach().to(dtype).t().contiguous(), torch.mm)}
    if dtype == torch.float32 or onednn.packs_bfloat16():
        kernels["oneDNN"] = (lambda w: onednn.pack(w, dtype), onednn.linear)
    return kernels


def _by_shape(linears: list) -> dict[tuple[int, int], list[int]]:
    """The indices of ``linears`` per (in, out) shape."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, m in enumerate(linears):
        groups.setdefault((m.in_features, m.out_features), []).append(i)
    return groups


def _compiled_products():
    """A fresh compiled call ``(vectors, row-sum weights) -> products``, with the decode step's
    options: one graph per list of shapes it is given."""
    def products(xs, ws):
        return [matmul_packed(x, w, None, ROWSUM) for x, w in zip(xs, ws, strict=True)]

    call = torch.compile(products, dynamic=False, fullgraph=True, options=cpu_step_options())
    return torch._dynamo.config.patch(recompile_limit=64)(call)  # a graph per shape list


def _seconds(call, *args) -> float:
    start = clock()
    call(*args)
    return clock() - start


def run_interleaved(variants: dict):
    """Warm every variant up, then time them in turn; (wall, cpu, outputs) per name. The bound
    is timed as ``tokens`` passes, so its rates read as tokens/s too."""
    for run, _ in variants.values():
        run(4)
    times = {name: [] for name in variants}
    cpu = {name: [] for name in variants}
    outputs = {}
    for r in range(max(reps for _, reps in variants.values())):
        for name, (run, reps) in variants.items():
            if r < reps:
                start, start_cpu = time.perf_counter(), time.process_time()
                outputs[name] = run()
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    return times, cpu, outputs


def report(times, cpu, outputs, args) -> None:
    n = args.new_tokens
    rate = {name: n / statistics.median(ts) for name, ts in times.items()}
    cpu_rate = {name: n / statistics.median(ts) for name, ts in cpu.items()}
    for bound, passes in PASSES.items():  # the bound: the faster pass, by each clock
        for r in (rate, cpu_rate):
            if passes[0] in r:
                r[bound] = max(r[p] for p in passes if p in r)
    ref = outputs.get(NOCACHE, outputs.get(REF))
    print(f"\ngreedy decoding, batch 1, {args.prompt_tokens}-token prompt, {n} new tokens, GPT-2 "
          f"small random weights, torch {torch.__version__}, {args.threads} thread(s)")
    print(f"{'variant':<40} {'tok/s':>6} {'of bound':>8} {'cpu tok/s':>9} {'of bound':>8}  "
          "same tokens as uncached (bf16: float32 on bf16-rounded weights)")
    for name in times:
        bound = BOUND_BF16 if "bf16" in name else BOUND
        expected = outputs.get(BF16_REFERENCE) if "bf16" in name else ref
        same = "-" if name.startswith("bound") or outputs[name] is None or expected is None \
            else "yes" if torch.equal(outputs[name], expected) else \
            f"first {_common_prefix(outputs[name], expected) - args.prompt_tokens} tokens"
        print(f"{name:<40} {rate[name]:>6.1f} {rate[name] / rate[bound]:>8.0%} "
              f"{cpu_rate[name]:>9.1f} {cpu_rate[name] / cpu_rate[bound]:>8.0%}  {same}")
    for label, r in (("wall", rate), ("cpu", cpu_rate)):
        print(f"\nratios ({label} time)")
        fp32 = max((name for name in (REF, COMPILED) if name in r), key=r.get, default=None)
        bf16 = max((name for name in (BF16, COMPILED_BF16) if name in r), key=r.get, default=None)
        if fp32 is not None:
            print(f"  fastest fp32 ({fp32}): {r[fp32] / r[BOUND]:.0%} of the bound (target >= 85%)"
                  + (f", {r[fp32] / r[HF]:.2f}x transformers fp32 (target >= 1.3x)"
                     if HF in r else ""))
            print(f"  ours fp32 packed: {r[REF] / r[BOUND]:.0%} of the bound; cached / no cache: "
                  f"{r[REF] / r[NOCACHE]:.1f}x" + (f"; {r[REF] / r[HF]:.2f}x transformers "
                                                   f"({r[PLAIN] / r[HF]:.2f}x with nn.Linear)"
                                                   if HF in r else ""))
        if COMPILED in r:
            print(f"  ours fp32 compiled step / eager packed: {r[COMPILED] / r[REF]:.2f}x "
                  "(compile time apart, above)")
        if fp32 is not None and bf16 is not None:
            print(f"  fastest bf16 / fastest fp32: {r[bf16] / r[fp32]:.2f}x (target >= 1.6x on a "
                  f"CPU with native bf16; the bounds' ratio {r[BOUND_BF16] / r[BOUND]:.2f}x; "
                  f"{bf16} / {fp32})")
            for b, f in ((BF16, REF), (COMPILED_BF16, COMPILED)):
                if b in r and f in r:
                    print(f"  {b} / {f}: {r[b] / r[f]:.2f}x ({r[b] / r[BOUND_BF16]:.0%} of "
                          "the bf16 bound)")


def report_shapes(layouts: dict, args) -> None:
    """Per float32 weight shape: ms per one-vector product of each layout (the bound's trial
    passes) and the layout the packed model applied, against nn.Linear's."""
    if not layouts:
        return
    print(f"\nper shape (ms per product, each matrix from memory; {args.clock} time)")
    rowsum = all(ROWSUM in seconds for seconds, _ in layouts.values())
    print(f"{'in x out':<12} {'nn.Linear':>9} {'(in,out)':>9} {'oneDNN':>9} {'applied':>9} "
          f"{'vs nn.Linear':>12}" + (f" {'row-sum compiled':>16} {'vs nn.Linear':>12}"
                                     if rowsum else ""))
    for (d_in, d_out), (seconds, kernel) in layouts.items():
        ms = {k: seconds[k] * 1e3 for k in seconds}
        plain = ms["nn.Linear"]
        line = (f"{f'{d_in}x{d_out}':<12} {plain:>9.3f} {ms['(in, out)']:>9.3f} "
                f"{ms.get('oneDNN', float('nan')):>9.3f} {kernel:>9} {plain / ms[kernel]:>11.2f}x")
        if rowsum:
            line += f" {ms[ROWSUM]:>16.3f} {plain / ms[ROWSUM]:>11.2f}x"
        print(line)


@torch.no_grad()
def report_prompt_products(rowsum: dict, args, repeats: int = 7) -> None:
    """Per weight shape of each compiled decoder's model (``rowsum``: dtype -> model or None):
    ms per product of a prompt's rows (``--prompt-tokens`` x in) by its row-sum weights, each of
    ``PROMPT_PRODUCTS`` (bfloat16 weights widened block by block), and the one
    ``speed_up_decoding``'s rule applied; each matrix from memory, in the model's order, medians of
    interleaved passes. Not the LM head: a prompt multiplies only its last row by it."""
    models = {dtype: m for dtype, m in rowsum.items() if m is not None}
    if not models:
        return
    print(f"\nprompt rows ({args.prompt_tokens} x in) by row-sum weights, ms per product "
          f"({args.clock} time)")
    print(f"{'in x out':<12} {'dtype':<9} {'x @ W.T':>9} {'W @ x.T':>9} {'applied':>9} "
          f"{'vs x @ W.T':>10}")
    for dtype, model in models.items():
        layers = [m for m in model.modules()
                  if isinstance(m, PackedLinear) and m is not model.lm_head]
        rows = {m.in_features: torch.randn(args.prompt_tokens, m.in_features) for m in layers}
        seconds = {p: [[] for _ in layers] for p in PROMPT_PRODUCTS}
        for _ in range(repeats + 1):  # the first pass warms up
            for product in PROMPT_PRODUCTS:
                for i, m in enumerate(layers):
                    start = clock()
                    matmul_packed(rows[m.in_features], m._packed, None, ROWSUM, product)
                    seconds[product][i].append(clock() - start)
        for (d_in, d_out), idx in _by_shape(layers).items():
            ms = {p: statistics.mean(statistics.median(seconds[p][i][1:]) for i in idx) * 1e3
                  for p in PROMPT_PRODUCTS}
            applied = layers[idx[0]].product
            print(f"{f'{d_in}x{d_out}':<12} {str(dtype).removeprefix('torch.'):<9} "
                  f"{ms['x @ W.T']:>9.3f} {ms['W @ x.T']:>9.3f} {applied:>9} "
                  f"{ms['x @ W.T'] / ms[applied]:>9.2f}x")


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
