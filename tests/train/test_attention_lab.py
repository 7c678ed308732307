"""The attention lab end to end, shrunk: ``python train.py -m experiment=attention_variants``
(a real Hydra multirun, tiny model, a few steps, three of the variants) and
``bench/attention_runs.py`` turning its runs into the table and the picture."""

from __future__ import annotations

import pytest
from lab_runs import ROOT, SHRUNK, _python


@pytest.mark.usefixtures("one_thread")
def test_shrunk_multirun_and_its_table(tmp_path):
    sweep = tmp_path / "sweep"
    _python(tmp_path, ROOT / "train.py", "-m", "experiment=attention_variants",
            "attention=gpt2,mqa,rope_window", f"hydra.sweep.dir={sweep}",
            f"data_root={tmp_path / 'data'}", *SHRUNK)
    runs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert runs == ["gpt2", "mqa", "rope_window"]
    for run in runs:  # one directory per variant, with what the table reads
        assert (sweep / run / "checkpoints" / "last.ckpt").is_file()
        assert (sweep / run / "csv").is_dir()

    png = tmp_path / "lab.png"
    table = _python(tmp_path, "-m", "bench.attention_runs", sweep, "--repeats", "1",
                    "--new-tokens", "4", "--out", png)
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| run")}
    assert list(rows) == ["gpt2", "mqa", "rope_window"]  # the order the sweep ran them
    assert "1/2 kv heads, learned" in rows["mqa"] and "| +0.000 |" in rows["gpt2"]
    assert "rope, window 64" in rows["rope_window"]
    kv_bytes = {name: int(line.split("|")[8].replace(",", "")) for name, line in rows.items()}
    assert kv_bytes == {"gpt2": 2 * 2 * 2 * 16 * 4, "mqa": 2 * 2 * 1 * 16 * 4,
                        "rope_window": 2 * 2 * 2 * 16 * 4}
    assert "val/loss within 0.05 of gpt2:" in table
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("fields", [{}, {"num_kv_heads": 1}, {"num_kv_heads": 4},
                                    {"position": "rope"}, {"position": "rope", "window": 16}])
def test_memory_preflight_counts_each_variants_weights(fields):
    import torch

    from minigpt.model import GPT, GPTConfig
    from minigpt.train.memory import estimate_training_memory

    config = dict(n_layer=2, n_head=12, n_embd=96, context_length=64, vocab_size=128, **fields)
    with torch.device("meta"):
        model = GPT(GPTConfig(**config))
    assert estimate_training_memory(config, 1).weights == 4 * model.num_params()


def test_variant_benchmarks_run_in_a_tiny_mode(tmp_path):
    """The benchmarks behind docs/attention_variants.md, shrunk so they cannot rot."""
    table = _python(tmp_path, "-m", "bench.attention", "--variants", "--lengths", "16",
                    "--warmup", "0", "--repeats", "1", "--threads", "1")
    rows = [line.split() for line in table.splitlines() if line.startswith("   16 ")]
    assert [row[1] for row in rows] == ["gpt2", "gqa4", "mqa", "rope", "window256",
                                        "rope+window256"]
    assert all(float(row[4]) > 0 for row in rows)  # each variant's peak memory, measured
    decoding = _python(tmp_path, "-m", "bench.attention_decoding", "--layers", "1",
                       "--cached", "8", "--new-tokens", "2", "--repeats", "1", "--long", "1",
                       "--vocab-size", "64",
                       "--threads", "1")
    kv = {line.split()[0]: line.split()[3] for line in decoding.splitlines()
          if line.split() and line.split()[0] in ("gpt2", "gqa4", "mqa")}
    assert kv == {"gpt2": "6,144", "gqa4": "2,048", "mqa": "512"}
    assert "rope+window64" in decoding and "524,288" in decoding  # 64-slot rings, 4 layers
