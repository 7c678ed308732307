"""The recipe lab end to end, shrunk: ``python train.py -m experiment=recipe_lab`` (a real Hydra
multirun, tiny model, a few steps, three rungs) and ``bench/recipe_runs.py`` turning its runs
into the table and the picture; ``recipe=modern`` composes over every model size."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from lab_runs import ROOT, SHRUNK, _python


@pytest.mark.parametrize("model", ["toy", "gpt2_small", "gpt2_xl"])
def test_the_modern_recipe_goes_on_top_of_any_model(model):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        plain = compose("train", overrides=[f"model={model}"])
        modern = compose("train", overrides=[f"model={model}", "recipe=modern"])
    assert (modern.model.n_layer, modern.model.n_embd) == (plain.model.n_layer, plain.model.n_embd)
    assert (modern.model.position, modern.model.norm, modern.model.mlp) == ("rope", "rmsnorm", "relu2")
    assert modern.model.qk_norm and not modern.model.tie_head and modern.model.zero_init_proj
    assert not modern.model.value_embeddings  # an option; it overfits small corpora
    assert modern.optim.muon_lr == 0.015
    assert (modern.optim.name, modern.optim.schedule) == ("muon", "wsd")
    assert modern.optim.lr == plain.optim.lr  # the model's AdamW settings stay for the rest
    assert (plain.model.position, plain.optim.name) == ("learned", "adamw")  # recipe=gpt2


@pytest.mark.usefixtures("one_thread")
def test_shrunk_multirun_and_its_table(tmp_path):
    sweep = tmp_path / "sweep"
    _python(tmp_path, ROOT / "train.py", "-m", "experiment=recipe_lab",
            "recipe=gpt2,muon_wsd,modern", f"hydra.sweep.dir={sweep}",
            f"data_root={tmp_path / 'data'}", *SHRUNK)
    runs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert runs == ["gpt2", "modern", "muon_wsd"]
    png = tmp_path / "lab.png"
    table = _python(tmp_path, "-m", "bench.recipe_runs", sweep, "--out", png)
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| run")}
    assert list(rows) == ["gpt2", "muon_wsd", "modern"]  # the order the sweep ran them
    assert "| 4 | 100% |" in rows["gpt2"]  # the baseline reaches its own loss at its last step
    assert png.stat().st_size > 10_000


def test_time_per_step_benchmark_runs_every_rung(tmp_path):
    out = _python(tmp_path, "-m", "bench.recipe_step", "--recipes", "gpt2", "muon",
                  "modern", "--batch", "1", "--warmup", "1", "--repeats", "1", "--threads", "1")
    assert "modern: compiled blocks (norm=rmsnorm, qk_norm, position=rope, mlp=relu2)" in out
    rows = [line.split()[0] for line in out.splitlines() if line.endswith("x")]
    assert rows == ["gpt2", "muon", "modern"]
