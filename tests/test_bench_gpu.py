"""bench/gpu.py in its CPU self-test mode, so the GPU check never rots: the training step of
ours and transformers', a real train.py run, decoding, and the target lines all print."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_bench_self_test_prints_its_table(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"}
    result = subprocess.run([sys.executable, "-m", "bench.gpu", "--self-test"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("CPU, torch ") and "model 2 x 32" in lines[0]
    for start in ("training step", "ours ", "train.py, 1 process(es)", "train.py, auto: B=", "decoding new tokens/s",
                  "batch 1 ", "batch 8 ", "target training >= 1.3x",
                  "target decoding >= 3x transformers at batch 1", "ours, Muon ",
                  "ours, recipe=modern ", "target Muon's step within 5%", "recipe=modern's step",
                  "ours, ac=blocks ", "ours, ac=selective ", "activation checkpointing=blocks: ",
                  "compile=blocks against the whole graph: n/a"):
        assert any(line.startswith(start) for line in lines), (start, result.stdout)
    assert "SAMPLES OFF" not in result.stdout
