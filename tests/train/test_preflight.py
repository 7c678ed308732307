"""minigpt.train.memory: the memory estimate against parameter counts, measured peaks and the
one-line refusal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minigpt.errors import ResourceError
from minigpt.model import GPT, GPTConfig
from minigpt.train.memory import (
    GiB,
    check_memory,
    estimate_training_memory,
)

ROOT = Path(__file__).resolve().parents[2]
GPT2_SMALL = dict(n_layer=12, n_head=12, n_embd=768, context_length=1024, vocab_size=50257)
TOY = dict(n_layer=4, n_head=4, n_embd=256, context_length=256, vocab_size=128)


@pytest.mark.parametrize("config", [GPT2_SMALL, TOY])
def test_parameter_count_matches_the_model(config):
    with torch.device("meta"):
        model = GPT(GPTConfig(**config))
    assert GPTConfig(**config).num_params() == sum(p.numel() for p in model.parameters())
    assert GPTConfig().num_params() == 124_439_808  # GPT-2 small, as published


def test_estimate_scales_as_it_should():
    one = estimate_training_memory(GPT2_SMALL, 1)
    two = estimate_training_memory(GPT2_SMALL, 2)
    assert two.activations == pytest.approx(2 * one.activations, rel=0.01)
    assert two.weights == one.weights and two.optimizer == 2 * one.weights  # AdamW: 2 moments
    eight = estimate_training_memory(GPT2_SMALL, 8)  # the chunks do not grow with the batch
    assert estimate_training_memory(GPT2_SMALL, 8, chunked_loss=True).loss < eight.loss / 8
    sharded = estimate_training_memory(GPT2_SMALL, 2, shards=8)
    assert sharded.optimizer == pytest.approx(two.optimizer / 8, rel=1e-6)
    recomputed = estimate_training_memory(GPT2_SMALL, 2, activation_checkpointing="blocks")
    assert recomputed.activations < two.activations / 4
    half = estimate_training_memory(GPT2_SMALL, 2, precision="bf16-mixed")
    assert half.activations < two.activations


def test_check_memory_refuses_in_one_line_with_the_knobs():
    estimate = estimate_training_memory(TOY, 100_000)
    with pytest.raises(ResourceError) as error:
        check_memory(estimate, 16 * GiB, "this machine's RAM",
                     {"data.batch_size": 100_000, "model.context_length": 256})
    message = str(error.value)
    assert "\n" not in message
    assert f"needs about {estimate.total / GiB:.2f} GiB" in message and "16.00 GiB" in message
    for knob in ("data.batch_size=100000", "model.context_length=256", "accumulate_grad_batches",
                 "trainer=fsdp", "activation_checkpointing"):
        assert knob in message
    check_memory(estimate_training_memory(TOY, 1), 16 * GiB, "RAM", {})  # fits: no error


def test_estimate_is_within_30_percent_of_measured_peaks():
    """bench.memory's quick cases (toy runs, GPT-2 small at T=128), each in its own process;
    the toy's float32 step in each activation checkpointing mode peaks lowest under blocks and
    between under selective."""
    out = subprocess.run([sys.executable, "-m", "bench.memory", "--quick", "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, check=True)
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert {r["case"].split(",")[0] for r in rows} == {"toy", "GPT-2 small"}
    for row in rows:
        assert abs(row["error"]) <= 0.30, row
    peaks = {r["mode"]: r["measured"] for r in rows if r["case"].startswith("toy, fp32, chunked")}
    assert peaks["blocks"] < peaks["selective"] < peaks["none"], peaks
