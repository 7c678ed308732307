"""The GPU path end to end, in one command that prints a table.

    python -m bench.gpu                  # CUDA: GPT-2 small, T=1024, bf16, compile auto
    python -m bench.gpu --batch 16 --new-tokens 256
    python -m bench.gpu --self-test      # a tiny config on the CPU in seconds (the default
                                         # without CUDA; the test suite runs it so it never rots)
    python -m bench.gpu --compile-only   # 3.'s compile rows alone (on the CPU: model=toy)
    python -m bench.gpu --skip compile,documents   # leave out 3.'s compiles and 5. (training: 1.)

1. Training step, side by side in this process, each the training loop's own step
   (``bench.loop_step``: Fabric bf16-mixed, fused AdamW, gradient clipping, the schedule): our
   ``GPT`` the way a run trains it (forward and loss compiled together when ``compile: auto``
   says so) and ``transformers.GPT2LMHeadModel`` (SDPA attention, forward + cross-entropy
   compiled alike), same shapes and batch: tokens/s, MFU against the GPU's peak
   (``minigpt.train.device.peak_flops``: dense figures), the step's peak memory above what stays resident.
   Beside them: our GPT-2 stepped by Muon (``optim=muon``: Muon for the blocks' matrices, AdamW
   for the rest) and ``recipe=modern``'s model and optimizers (read from ``configs/recipe``).
2. ``train.py`` itself for a few dozen steps (defaults: precision and compile auto, GPT-2 small
   shapes on character data with the vocabulary pinned to 50304, so no download): the tokens/s
   and MFU it logs; the same with ``data.batch_size=auto`` (the micro-batch it chose on the
   card, and its MFU); then the same on 2 processes (DDP) when there are 2+ GPUs.
3. Fitting (issue 31): ``compile=blocks`` (each transformer block compiled once, reused) against
   the whole-graph compile: compile seconds (the first step less a compiled one, each in a fresh
   process with inductor's caches off) and step ms; and our step with activation checkpointing
   (rows ``ac=blocks``, ``ac=selective``) beside the rows of 1., MFU counting the model's
   FLOPs only (not the recomputation).
4. Decoding as ``generate.py`` does it (``dtype=auto``: bf16 weights on GPUs; ``decoder=auto``:
   the compiled fixed-shape decoder, one CUDA graph per token, on GPUs; greedy) against
   ``transformers`` ``generate`` (bf16, cache), batch 1 and 8.
5. The document mask (``bench.gpu_documents``): GPT-2 small's step on packed documents with
   FlexAttention's block mask against causal SDPA at T=1024 and 8192, and with a 1024 window
   against dense causal attention at 8192.

Variants are stepped interleaved after warm-up (compilation happens there); medians. Targets
(issue 11): training >= 1.3x transformers and >= 40% MFU on an H100; decoding >= 3x transformers
at batch 1; (issue 21) Muon's step at most 5% slower than AdamW's; (issue 31) compile=blocks
compiles in under half the whole graph's seconds, its step within 3% of the whole graph's.
Without ``transformers`` installed its rows are skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import gpu_documents
from bench.loop_step import CausalLMWithLoss, loop_step
from bench.recipe_configs import optim_settings, recipe
from bench.timing import medians, time_interleaved
from minigpt.devices import inference_dtype
from minigpt.inference import place_model
from minigpt.model import GPT, GPTConfig
from minigpt.sampling import generate
from minigpt.static_decoding import StaticDecoder
from minigpt.train.activation_checkpointing import apply_activation_checkpointing
from minigpt.train.device import compile_enabled, peak_flops

ROOT = Path(__file__).resolve().parents[1]  # the checkout: configs/, train.py

OPTIM = {"lr": 6e-4, "min_lr": 6e-5, "warmup_steps": 10, "decay_steps": 1000,
         "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}


@dataclass
class Plan:
    """What to measure where: shapes, batch, repeats, and the train.py overrides that size it."""

    device: torch.device
    config: GPTConfig
    batch: int
    warmup: int
    repeats: int
    prompt_tokens: int
    new_tokens: int
    run_steps: int
    run_overrides: list[str]

    @property
    def compiled(self) -> bool:
        return compile_enabled("auto", "gpu" if self.device.type == "cuda" else "cpu")


def gpu_plan(args) -> Plan:
    config = GPTConfig(vocab_size=50304, context_length=1024, n_layer=12, n_head=12, n_embd=768)
    return Plan(torch.device("cuda"), config, args.batch, warmup=3, repeats=args.repeats,
                prompt_tokens=16, new_tokens=args.new_tokens, run_steps=60,
                run_overrides=["model=gpt2_small", "model.vocab_size=50304",
                               f"data.batch_size={args.batch}"])


def toy_plan() -> Plan:
    """model=toy's shapes with GPT-2's vocabulary on the CPU (``--compile-only`` there)."""
    config = GPTConfig(vocab_size=50304, context_length=256, n_layer=4, n_head=4, n_embd=256)
    return replace(tiny_plan(), config=config, batch=8)


def tiny_plan() -> Plan:
    config = GPTConfig(vocab_size=128, context_length=64, n_layer=2, n_head=2, n_embd=32)
    return Plan(torch.device("cpu"), config, batch=2, warmup=1, repeats=2, prompt_tokens=4,
                new_tokens=8, run_steps=3,
                run_overrides=["model.n_layer=2", "model.n_head=2", "model.n_embd=32",
                               "model.context_length=64", "data.batch_size=2",
                               "data.val_tokens=128", "trainer=cpu", "threads=1"])


# ---- 1. the training step, ours vs transformers ---------------------------------------------

def _train_step(model: torch.nn.Module, plan: Plan, optim: dict | None = None,
                fullgraph: bool = True, compile: bool | str | None = None):
    """The loop's own optimizer step (``bench.loop_step``) under bf16-mixed, the loss compiled
    when ``plan.compiled`` (or as ``compile`` says: ``blocks``, each block on its own):
    ``optim`` (default: train.py's AdamW) over ``OPTIM``'s schedule."""
    return loop_step(model, {**(optim or optim_settings()), **OPTIM}, precision="bf16-mixed",
                     accelerator=plan.device.type,
                     compile=plan.compiled if compile is None else compile, fullgraph=fullgraph)


def _has_transformers() -> bool:
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return False
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its notes about our random configs are not results
    hf_logging.disable_progress_bar()
    return True


def _transformers_model(config: GPTConfig):
    """A fresh float32 ``GPT2LMHeadModel`` of ``config``'s shapes, SDPA attention, no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_config = GPT2Config(vocab_size=config.vocab_size, n_positions=config.context_length,
                           n_embd=config.n_embd, n_layer=config.n_layer, n_head=config.n_head,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                           bos_token_id=None, eos_token_id=None)
    return GPT2LMHeadModel._from_config(hf_config, attn_implementation="sdpa")


def training_steps(plan: Plan, attention: dict) -> dict:
    """name -> one training step, each with its own model and optimizer. When transformers
    attends with an explicit (T, T) mask under compile (``attention``: what each side calls, see
    ``attention_calls``), it is also timed with causal SDPA, the kernel ours runs."""
    ours = GPT(plan.config).to(plan.device).train()
    steps = {"ours": _train_step(ours, plan)}
    muon = GPT(plan.config).to(plan.device).train()
    steps["ours, Muon"] = _train_step(muon, plan, recipe("muon")[1])
    options, optim = recipe("modern")
    modern = GPT(replace(plan.config, **options)).to(plan.device).train()
    steps["ours, recipe=modern"] = _train_step(modern, plan, optim)
    for mode in ("blocks", "selective"):
        checkpointed = GPT(plan.config).to(plan.device).train()
        apply_activation_checkpointing(checkpointed, mode)
        steps[f"ours, ac={mode}"] = _train_step(checkpointed, plan)
    if plan.compiled:
        steps["ours, compile=blocks"] = _train_step(GPT(plan.config).to(plan.device).train(),
                                                    plan, compile="blocks")
    if _has_transformers():
        hf = CausalLMWithLoss(_transformers_model(plan.config).train())
        steps["transformers"] = _train_step(hf, plan, fullgraph=False)
        if "mask" in attention.get("transformers", ""):
            causal = CausalLMWithLoss(_transformers_model(plan.config).train(),
                                      attention=lambda: _sdpa_spy(force_causal=True))
            steps["transformers, causal SDPA"] = _train_step(causal, plan, fullgraph=False)
    return steps


@contextlib.contextmanager
def _sdpa_spy(seen: list | None = None, force_causal: bool = False):
    """Record each SDPA call's masking (``"is_causal"`` or ``"(T, T) mask"``), also while
    torch.compile traces; with ``force_causal`` a mask is replaced by ``is_causal=True``."""
    original = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        if seen is not None:
            seen.append("(T, T) mask" if attn_mask is not None else
                        "is_causal" if is_causal else "no mask, not causal")
        if force_causal and attn_mask is not None:
            attn_mask, is_causal = None, True
        return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        **kwargs)

    F.scaled_dot_product_attention = spy
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def attention_calls(plan: Plan) -> dict[str, str]:
    """How each side attends in a training forward as timed (compiled when ``plan.compiled``):
    transformers decides in ``masking_utils`` between ``is_causal`` and a (T, T) mask, and the
    answer depends on the torch version."""
    x = torch.randint(0, plan.config.vocab_size, (1, plan.config.context_length),
                      device=plan.device)
    models = {"ours": GPT(plan.config).to(plan.device)}
    if _has_transformers():
        hf = _transformers_model(plan.config).to(plan.device)
        models["transformers"] = lambda idx: hf(idx).logits
    calls = {}
    for name, model in models.items():
        seen: list[str] = []
        forward = torch.compile(model) if plan.compiled else model
        with _sdpa_spy(seen), torch.no_grad(), torch.autocast(plan.device.type, torch.bfloat16):
            forward(x)
        calls[name] = ", ".join(sorted(set(seen))) or "no SDPA call"
    return calls


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(runs: dict, plan: Plan, *args, forbid_syncs: tuple = ()) -> dict[str, float]:
    """Median seconds per call of each run, called in turn after ``plan.warmup`` calls each.
    ``forbid_syncs``: names of runs whose timed calls raise on CUDA if they read a value back
    to the host (``torch.cuda.set_sync_debug_mode("error")``)."""
    for run in runs.values():  # compilation happens here, where host syncs are allowed
        for _ in range(plan.warmup):
            run(*args)
    timed = {name: partial(_call, run, args, plan.device, name in forbid_syncs)
             for name, run in runs.items()}
    return medians(time_interleaved(timed, 0, plan.repeats, sync=partial(_sync, plan.device)))


def _call(run, args: tuple, device: torch.device, forbid_syncs: bool) -> None:
    with _no_syncs(device, forbid_syncs):
        run(*args)


@contextlib.contextmanager
def _no_syncs(device: torch.device, forbid: bool):
    if not (forbid and device.type == "cuda"):
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def step_peak_gib(run, device: torch.device, *args) -> float | None:
    """Peak memory one call allocates above what was resident before it (CUDA only)."""
    if device.type != "cuda":
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run(*args)
    _sync(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**30


def _batch(plan: Plan) -> torch.Tensor:
    """Tokens and targets, (2, B, T): the same for every variant."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, plan.config.vocab_size, (2, plan.batch, plan.config.context_length),
                         generator=gen).to(plan.device)


def training_table(plan: Plan, attention: dict) -> dict:
    steps = training_steps(plan, attention)
    x, y = _batch(plan)
    seconds = median_seconds(steps, plan, x, y, forbid_syncs=("ours",))
    peak = peak_flops(plan.device, torch.bfloat16)
    flops_per_token = _flops_per_token(plan.config)  # the same architecture for both
    rows = {}
    for name, step in steps.items():
        tokens_per_s = x.numel() / seconds[name]
        rows[name] = {"step_ms": 1e3 * seconds[name], "tokens_per_s": tokens_per_s,
                      "mfu": flops_per_token * tokens_per_s / peak if peak else None,
                      "peak_gib": step_peak_gib(step, plan.device, x, y)}
    return rows


def _flops_per_token(config: GPTConfig) -> float:
    with torch.device("meta"):
        return GPT(config).flops_per_token()


# ---- 2. train.py itself ---------------------------------------------------------------------

def train_py_run(plan: Plan, work: Path, processes: int = 1, auto_batch: bool = False,
                 data_root: Path | None = None) -> dict:
    """``train.py`` for ``plan.run_steps`` steps with precision and compile left on auto, one
    validation and sample at the end; what it logged last (tokens/s is its moving average, so
    the last logging interval's, so it must follow the compilation), the micro-batch it trained
    with (``auto_batch``: ``data.batch_size=auto`` chose it) and whether sampling failed.
    ``data_root`` (default ``work/data``) is where the token files are prepared or reused."""
    name = f"run{processes}" + ("auto" if auto_batch else "")
    overrides = [o for o in plan.run_overrides if not o.startswith("data.batch_size=")] + \
        ["data.batch_size=auto"] if auto_batch else plan.run_overrides
    args = [*overrides, "data=shakespeare_char", f"data_root={(data_root or work / 'data').resolve()}",
            f"hydra.run.dir={work / name}", "logger=csv", "sample.max_new_tokens=8",
            "trainer.enable_progress_bar=false", f"trainer.max_steps={plan.run_steps}",
            f"trainer.val_check_interval={plan.run_steps}", "trainer.limit_val_batches=1",
            f"trainer.log_every_n_steps={max(1, plan.run_steps // 3)}",
            f"trainer.devices={processes}"]
    if processes > 1:
        args.append("trainer.strategy=ddp")
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=work,
                            capture_output=True, text=True, timeout=1800)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise RuntimeError(f"train.py failed ({processes} process(es)):\n{output[-3000:]}")
    rows = [r for r in csv.DictReader((work / name / "csv" / "metrics.csv").open())
            if r.get("tokens_per_s")]
    last = rows[-1]
    precision = next((line.split(",")[0].removeprefix("precision: ")
                      for line in output.splitlines() if line.startswith("precision: ")), "?")
    batch = json.loads((work / name / "summary.json").read_text())["batch"]["batch_size"]
    return {"processes": processes, "precision": precision, "auto_batch": auto_batch,
            "batch": batch, "tokens_per_s": float(last["tokens_per_s"]),
            "mfu": float(last["mfu"]) if last.get("mfu") else None,
            "warnings": [line for line in output.splitlines() if "samples are off" in line]}


# ---- 3. compile=blocks against the whole-graph compile --------------------------------------

COMPILE_MODES = {"whole graph": True, "compile=blocks": "blocks"}  # name -> ModelWithLoss's


def compile_probe(plan: Plan, compile: bool | str, steps: int = 3) -> dict:
    """In this process: the seconds the first training step spends compiling (its time less a
    compiled step's) and a compiled step's ms (the median of ``steps``)."""
    step = _train_step(GPT(plan.config).to(plan.device).train(), plan, compile=compile)
    x, y = _batch(plan)
    seconds = []
    for _ in range(steps + 1):
        _sync(plan.device)
        start = time.perf_counter()
        step(x, y)
        _sync(plan.device)
        seconds.append(time.perf_counter() - start)
    steady = statistics.median(seconds[1:])
    return {"compile_s": seconds[0] - steady, "step_ms": 1e3 * steady}


def compile_table(flags: list[str]) -> dict:
    """``compile_probe`` of each of ``COMPILE_MODES``, each in a fresh process (run with
    ``flags``, so it builds this plan) with inductor's caches off, so neither reuses the
    other's kernels."""
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1", "PYTHONPATH": str(ROOT)}
    rows = {}
    for name, compile in COMPILE_MODES.items():
        out = subprocess.run([sys.executable, "-m", "bench.gpu", *flags, "--compile-probe",
                              json.dumps(compile)], env=env, capture_output=True, text=True,
                             timeout=1800)
        if out.returncode != 0:
            raise RuntimeError(f"compile probe {name} failed:\n{out.stderr[-3000:]}")
        rows[name] = json.loads(out.stdout.strip().splitlines()[-1])
    return rows


def compile_lines(rows: dict) -> list[str]:
    lines = [f"{'compile':<24} {'compile s':>9} {'step ms':>9}"]
    lines += [f"{name:<24} {r['compile_s']:>9.1f} {r['step_ms']:>9.1f}" for name, r in rows.items()]
    whole, blocks = rows["whole graph"], rows["compile=blocks"]
    return lines + ["", _target("compile=blocks compiles in < half the whole graph's time "
                                "(whole s / blocks s)", whole["compile_s"] / blocks["compile_s"],
                                2.0),
                    _target("compile=blocks step within 3% of the whole graph's (whole ms / "
                            "blocks ms)", whole["step_ms"] / blocks["step_ms"], 1 / 1.03)]


# ---- 4. decoding, generate.py's way vs transformers -----------------------------------------

def decoding_table(plan: Plan, batches=(1, 8)) -> dict:
    """New tokens/s of greedy decoding with the KV cache for each batch size."""
    device = str(plan.device)
    model = GPT(plan.config).eval()
    hf = _transformers_decoder(model, plan)
    compiled = plan.device.type == "cuda"  # generate.py's decoder=auto
    place_model(model, device, inference_dtype("auto", device), cpu_speedups=not compiled)
    rows = {}
    for batch in batches:
        prompt = torch.randint(0, plan.config.vocab_size, (batch, plan.prompt_tokens),
                               generator=torch.Generator().manual_seed(batch)).to(device)
        decoder = StaticDecoder(model, batch, compile=True) if compiled else None
        runs = {"ours": lambda p=prompt, d=decoder: generate(model, p, plan.new_tokens,
                                                             temperature=0, decoder=d)}
        if hf is not None:
            runs["transformers"] = lambda p=prompt: hf.generate(
                p, attention_mask=torch.ones_like(p), max_new_tokens=plan.new_tokens,
                min_new_tokens=plan.new_tokens, do_sample=False, use_cache=True, pad_token_id=0)
        with torch.inference_mode():
            seconds = median_seconds(runs, plan)
        rows[batch] = {name: batch * plan.new_tokens / s for name, s in seconds.items()}
    return rows


def _transformers_decoder(model: GPT, plan: Plan):
    """``transformers`` GPT-2 with ``model``'s weights, in bf16 on a GPU (float32 on the CPU)."""
    if not _has_transformers():
        return None
    from transformers import GPT2LMHeadModel

    dtype = torch.bfloat16 if plan.device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        hf = GPT2LMHeadModel.from_pretrained(tmp, attn_implementation="sdpa")
    hf.generation_config.eos_token_id = None  # always all new tokens, as ours
    return hf.to(plan.device, dtype).eval()


# ---- the table ------------------------------------------------------------------------------

def _fmt(value, spec: str) -> str:
    """``value`` formatted, or ``n/a`` padded to the same width."""
    width = int("".join(ch for ch in spec.split(".")[0] if ch.isdigit()) or 0)
    return f"{'n/a':>{width}}" if value is None else format(value, spec)


def _ratio(rows: dict, key: str, ours: str = "ours",
           theirs: str = "transformers") -> float | None:
    """``rows[ours][key] / rows[theirs][key]``; None where either row was not measured."""
    if ours not in rows or theirs not in rows:
        return None
    return rows[ours][key] / rows[theirs][key]


def report(plan: Plan, train: dict, runs: list[dict], decode: dict,
           attention: dict | None = None) -> list[str]:
    """The table, and one line per target: met, not met, or n/a."""
    c = plan.config
    name = torch.cuda.get_device_name(plan.device) if plan.device.type == "cuda" else "CPU"
    lines = [f"{name}, torch {torch.__version__}, compile {'on' if plan.compiled else 'off'}, "
             f"bf16 autocast; model {c.n_layer} x {c.n_embd} (heads {c.n_head}), vocab "
             f"{c.vocab_size}, T={c.context_length}, batch {plan.batch}", "",
             *[f"attention ({side}): SDPA {how}" for side, how in (attention or {}).items()], "",
             f"{'training step':<24} {'ms':>9} {'tokens/s':>11} {'MFU':>7} {'peak GiB':>9}"]
    for variant, row in train.items():
        lines.append(f"{variant:<24} {row['step_ms']:>9.1f} {row['tokens_per_s']:>11,.0f} "
                     f"{_fmt(row['mfu'], '>7.1%')} {_fmt(row['peak_gib'], '>9.2f')}")
    for run in runs:
        label = f"train.py, auto: B={run['batch']}" if run["auto_batch"] else \
            f"train.py, {run['processes']} process(es)"
        lines.append(f"{label:<24} {'':>9} {run['tokens_per_s']:>11,.0f} "
                     f"{_fmt(run['mfu'], '>7.1%')} {'':>9}  precision {run['precision']}"
                     + ("; SAMPLES OFF" if run["warnings"] else ""))
    lines += ["", f"{'decoding new tokens/s':<24} {'ours':>11} {'transformers':>13} {'ratio':>7}"]
    for batch, row in decode.items():
        ratio = _decode_ratio(row)
        lines.append(f"{'batch ' + str(batch):<24} {row['ours']:>11,.0f} "
                     f"{_fmt(row.get('transformers'), '>13,.0f')} "
                     + (f"{'n/a':>7}" if ratio is None else f"{ratio:>6.2f}x"))
    bare_and_run = {**train, "train.py": runs[0]}
    mfu = train.get("ours", {}).get("mfu") if "H100" in name else None
    modern = _ratio(train, "step_ms", "ours, recipe=modern", "ours")
    lines += ["", _target("training >= 1.3x transformers tokens/s", _ratio(train, "tokens_per_s"),
                          1.3),
              _target("training >= 1.3x transformers with causal SDPA",
                      _ratio(train, "tokens_per_s", theirs="transformers, causal SDPA"), 1.3),
              _target("train.py within 5% of the bare step's tokens/s",
                      _ratio(bare_and_run, "tokens_per_s", "train.py", "ours"), 0.95),
              _target("Muon's step within 5% of AdamW's (AdamW ms / Muon ms)",
                      _ratio(train, "step_ms", theirs="ours, Muon"), 1 / 1.05),
              f"recipe=modern's step: {_fmt(modern, '.2f')}x gpt2's",
              *[f"activation checkpointing={mode}: step "
                f"{_fmt(_ratio(train, 'step_ms', f'ours, ac={mode}', 'ours'), '.2f')}x none's"
                for mode in ("blocks", "selective")],
              _target("MFU >= 40% on an H100", mfu, 0.40),
              _target("decoding >= 3x transformers at batch 1",
                      _decode_ratio(decode[min(decode)]), 3.0)]
    return lines


def _decode_ratio(row: dict) -> float | None:
    """Our decoding tokens/s over transformers' in one batch's row; None where not measured."""
    return row["ours"] / row["transformers"] if "ours" in row and "transformers" in row else None


def _target(what: str, value: float | None, goal: float) -> str:
    verdict = "n/a" if value is None else ("met" if value >= goal else "NOT met")
    return f"target {what}: {verdict}" + ("" if value is None else f" ({value:.2f})")


def _progress(rows: dict) -> None:
    """Each finished row at once, so a run cut short by its time limit still reports it."""
    for name, row in rows.items():
        print(f"[done] {name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else
                                            f"{k}={v}" for k, v in row.items()), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--self-test", action="store_true",
                        help="a tiny config on the CPU in seconds (the default without CUDA)")
    parser.add_argument("--batch", type=int, default=12, help="micro-batch at T=1024 (GPU)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--compile-only", action="store_true",
                        help="only compile=blocks against the whole graph (CPU: model=toy)")
    parser.add_argument("--data-root", type=Path,
                        help="train.py's data_root: prepared token files to reuse (default: a "
                             "temporary folder, prepared there; preparing needs `datasets`)")
    parser.add_argument("--skip", default="", help="comma-separated sections to leave out on a "
                        "GPU: compile (3.'s fresh-process compiles), training (1.'s side-by-side "
                        "steps), documents (5.)")
    parser.add_argument("--compile-probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    if skip - {"compile", "training", "documents"}:
        parser.error(f"--skip={args.skip}: sections are compile, training, documents")
    torch.manual_seed(0)
    cuda = torch.cuda.is_available() and not args.self_test
    plan = gpu_plan(args) if cuda else toy_plan() if args.compile_only else tiny_plan()
    if cuda:
        torch.set_float32_matmul_precision("high")  # as train.py
    elif not args.compile_only:
        torch.set_num_threads(1)  # tiny models: a second thread mostly waits
    if args.compile_probe:
        print(json.dumps(compile_probe(plan, json.loads(args.compile_probe))))
        return 0
    if args.compile_only or (cuda and "compile" not in skip):
        flags = [f for f, on in (("--self-test", args.self_test),
                                 ("--compile-only", args.compile_only)) if on]
        compiles = compile_lines(compile_table(
            [*flags, f"--batch={args.batch}", f"--repeats={args.repeats}"]))
        if args.compile_only:
            print(f"{plan.device}, model {plan.config.n_layer} x {plan.config.n_embd}, "
                  f"T={plan.config.context_length}, batch {plan.batch}, bf16 autocast")
            print("\n".join(compiles))
            return 0
        print("\n".join(compiles), flush=True)  # the slow rows: keep them if a later one fails
    else:
        compiles = ["compile=blocks against the whole graph: n/a (python -m bench.gpu "
                    "--compile-only)"]
    attention = attention_calls(plan)
    train = {} if cuda and "training" in skip else training_table(plan, attention)
    progress = _progress if cuda else lambda rows: None  # the self-test's output is the table
    progress({f"step {name}": row for name, row in train.items()})
    with tempfile.TemporaryDirectory() as tmp:
        run = partial(train_py_run, plan, Path(tmp), data_root=args.data_root)
        runs = [run()]
        progress({"train.py": runs[-1]})
        runs.append(run(auto_batch=True))
        progress({"train.py, auto": runs[-1]})
        if cuda and torch.cuda.device_count() >= 2:
            runs.append(run(processes=2))
    decode = decoding_table(plan)
    print("\n".join([*report(plan, train, runs, decode, attention), "", *compiles]))
    if cuda and "documents" not in skip:  # its own self-test: python -m bench.gpu_documents --self-test
        print("\n" + "\n".join(gpu_documents.run(plan.device, args.repeats)))
    if not cuda:
        print("(self-test on the CPU: the numbers say the path runs, not how fast a GPU runs it)")
    return 1 if any(run["warnings"] for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
