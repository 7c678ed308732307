"""Attention maps and run plots: the weights by invariants and a hand computation, PNGs by size,
run plots on a real short training run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minigpt.model import GPT, GPTConfig
from minigpt.viz.attention_maps import (
    attention_maps,
    figure_layout,
    plot_attention,
    select_panels,
    token_labels,
)

TINY = dict(vocab_size=50, context_length=16, n_layer=2, n_head=2, n_embd=32)


def tiny_gpt(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **overrides}))


class CharTokenizer:
    """Stand-in with the Tokenizer interface's decode: id i <-> chr(32 + i)."""

    def decode(self, ids):
        return "".join(chr(32 + i) for i in ids)


# --- attention_maps ------------------------------------------------------------------------


def test_maps_are_causal_rows_sum_to_one_one_per_layer():
    model = tiny_gpt()
    idx = torch.randint(0, 50, (3, 12))
    maps = attention_maps(model, idx)
    assert len(maps) == TINY["n_layer"]
    upper = torch.ones(12, 12, dtype=torch.bool).triu(1)
    for w in maps:
        assert w.shape == (3, TINY["n_head"], 12, 12)
        assert torch.all(w[..., upper] == 0)
        assert torch.all(w[..., ~upper] > 0)  # the check above is not vacuous: softmax > 0
        torch.testing.assert_close(w.sum(-1), torch.ones(3, TINY["n_head"], 12))


def test_maps_match_a_hand_computation_layer_by_layer():
    """Independent oracle: q, k from the fused weight's row blocks, softmax by hand, and the
    residual stream advanced with the model's own blocks."""
    model = tiny_gpt(seed=1).eval()
    T, nh, C = 10, TINY["n_head"], TINY["n_embd"]
    hd = C // nh
    idx = torch.randint(0, 50, (2, T))
    maps = attention_maps(model, idx)
    with torch.no_grad():
        x = model.tok_emb(idx) + model.pos_emb(torch.arange(T))
        for block, got in zip(model.blocks, maps, strict=True):
            h = block.norm1(x)
            wq, wk, _ = block.attn.qkv.weight.split(C, dim=0)
            bq, bk, _ = block.attn.qkv.bias.split(C, dim=0)
            q = (h @ wq.T + bq).view(2, T, nh, hd).transpose(1, 2)
            k = (h @ wk.T + bk).view(2, T, nh, hd).transpose(1, 2)
            scores = q @ k.transpose(-1, -2) / hd**0.5
            scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), -torch.inf)
            torch.testing.assert_close(got, scores.softmax(-1))
            x = block(x)


def test_weights_times_values_give_the_fused_layer_output():
    """The maps are the weights the fast SDPA path really uses: weights @ v -> out_proj equals
    the attention layer's forward output."""
    model = tiny_gpt(seed=2).eval()
    idx = torch.randint(0, 50, (1, 9))
    attn = model.blocks[1].attn
    seen = {}
    handle = attn.register_forward_hook(lambda m, args, out: seen.update(x=args[0], y=out))
    with torch.no_grad():
        model(idx)
    handle.remove()
    w = attention_maps(model, idx)[1]  # (1, nh, T, T)
    B, T, C = seen["x"].shape
    v = attn.qkv(seen["x"])[..., 2 * C :].view(B, T, attn.num_heads, -1).transpose(1, 2)
    with torch.no_grad():
        y = attn.out_proj((w @ v).transpose(1, 2).reshape(B, T, C))
    torch.testing.assert_close(y, seen["y"])


def test_padded_keys_get_zero_weight():
    model = tiny_gpt(seed=3)
    T = 8
    idx = torch.randint(0, 50, (2, T))
    pad = torch.zeros(2, T, dtype=torch.bool)
    pad[0, :3] = True  # left padding: the prompt starts at column 3
    pad[1, 5] = True  # a hole in the middle
    pos = (torch.cumsum(~pad, dim=1) - 1).clamp(min=0)  # first real token at position 0
    maps = attention_maps(model, idx, key_padding_mask=pad, position_ids=pos)
    for w in maps:
        assert torch.all(w[0, :, :, :3] == 0)
        assert torch.all(w[1, :, :, 5] == 0)
        rows = w[0, :, 3:].sum(-1)  # real queries of row 0: weights still sum to 1
        torch.testing.assert_close(rows, torch.ones_like(rows))
        torch.testing.assert_close(w[1].sum(-1), torch.ones(TINY["n_head"], T))
        assert torch.all(w[0, :, :3] == 0)  # queries with no visible key: all zero, not NaN
    # the same prompt alone gives the same weights among its own tokens
    alone = attention_maps(model, idx[:1, 3:])
    for w, w_alone in zip(maps, alone, strict=True):
        torch.testing.assert_close(w[0, :, 3:, 3:], w_alone[0], atol=1e-6, rtol=1e-5)


def test_maps_leave_the_model_as_they_found_it():
    model = tiny_gpt(dropout=0.5).train()
    idx = torch.randint(0, 50, (1, 6))
    first, second = attention_maps(model, idx), attention_maps(model, idx)
    for a, b in zip(first, second, strict=True):  # eval mode inside: dropout off, repeatable
        torch.testing.assert_close(a, b)
    assert model.training
    assert all(not b.attn._forward_pre_hooks for b in model.blocks)


# --- labels, layout, PNG -------------------------------------------------------------------


def test_token_labels_make_whitespace_visible():
    class Decode:
        def decode(self, ids):
            return {0: " the", 1: "\n", 2: "cat ", 3: " ", 4: "a\tb"}[ids[0]]

    assert token_labels(Decode(), [0, 1, 2, 3, 4]) == ["␣the", "\\n", "cat␣", "␣", "a\\tb"]


def test_figure_layout_is_square_and_grows_with_tokens():
    assert figure_layout(12, 8)[:2] == (3, 4)
    assert figure_layout(4, 8)[:2] == (2, 2)
    assert figure_layout(1, 8)[:2] == (1, 1)
    assert figure_layout(2, 64)[2] > figure_layout(2, 8)[2]
    with pytest.raises(ValueError, match="at least one panel"):
        figure_layout(0, 8)


def test_select_panels_heads_or_layer_means():
    maps = attention_maps(tiny_gpt(), torch.randint(0, 50, (1, 5)))
    panels, titles = select_panels(maps, 1)
    assert len(panels) == TINY["n_head"] and titles[0] == "layer 1, head 0"
    torch.testing.assert_close(panels[1], maps[1][0, 1])
    panels, titles = select_panels(maps, "all")
    assert len(panels) == TINY["n_layer"]
    torch.testing.assert_close(panels[0], maps[0][0].mean(0))
    assert select_panels(maps, "-1")[1][0] == "layer 1, head 0"
    with pytest.raises(ValueError, match="out of range: the model has 2 layers"):
        select_panels(maps, 2)
    with pytest.raises(ValueError, match="integer or 'all'"):
        select_panels(maps, "first")


@pytest.mark.parametrize("layer,n_panels", [(0, TINY["n_head"]), ("all", TINY["n_layer"])])
def test_png_has_the_expected_pixel_size(tmp_path, layer, n_panels):
    from PIL import Image

    T = 12
    idx = torch.randint(0, 50, (1, T))
    maps = attention_maps(tiny_gpt(), idx)
    path = tmp_path / "heads.png"
    size = plot_attention(maps, token_labels(CharTokenizer(), idx[0].tolist()), path, layer)
    _, _, width, height = figure_layout(n_panels, T)
    assert size == (round(width * 100), round(height * 100))
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.size == size


def test_importing_the_package_does_not_import_matplotlib():
    code = ("import sys, minigpt, minigpt.viz, minigpt.viz.attention_maps, "
            "minigpt.viz.run_plots; assert 'matplotlib' not in sys.modules, 'matplotlib'")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- run plots -----------------------------------------------------------------------------


def write_csv_log(path, rows):
    """A metrics.csv as Lightning's CSVLogger writes it: the union of keys, blank cells."""
    import csv

    keys = sorted({k for row in rows for k in row})
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, keys)
        writer.writeheader()
        writer.writerows(rows)


def test_csv_log_merges_versions_and_places_val_rows_by_tokens(tmp_path):
    from minigpt.viz.run_plots import VAL_LOSS, load_run

    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    train = [{"step": s, "epoch": 0, "train/loss": 4.0 - 0.1 * s, "lr": 1e-3,
              "tokens": 512 * (s + 1)} for s in range(0, 10, 2)]
    write_csv_log(run_dir / "logs/version_0/metrics.csv", train + [{"step": 5, "val/loss": 3.7}])
    # a resume logged into version_10 (sorted after version_0 numerically) repeats step 8
    write_csv_log(run_dir / "logs/version_10/metrics.csv",
                  [{"step": 8, "train/loss": 3.0, "tokens": 4608},
                   {"step": 10, "train/loss": 2.9, "tokens": 5632},
                   {"step": 10, "val/loss": 3.1},
                   {"step": 12, "val/loss": 3.0}])  # after the last step that logged tokens
    run = load_run(run_dir)
    steps, loss = run.metrics["train/loss"]
    assert steps.tolist() == [0, 2, 4, 6, 8, 10]
    assert loss[-2:].tolist() == [3.0, 2.9]  # the resumed value wins
    val_steps, val = run.get(VAL_LOSS)
    assert val.tolist() == [3.7, 3.1, 3.0]
    # interpolated between steps 4 and 6; then extended at the last 512 tokens per step
    assert run.tokens_at(val_steps).tolist() == [3072, 5632, 6656]
    assert "epoch" not in run.metrics


def test_run_dir_errors_name_the_problem(tmp_path):
    from minigpt.viz.run_plots import find_logs

    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_logs(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no metrics.csv under .*logger=csv"):
        find_logs(tmp_path)
    wandb_only = tmp_path / "old" / "wandb" / "offline-run-1" / "run-1.wandb"
    wandb_only.parent.mkdir(parents=True)
    wandb_only.write_bytes(b":W&B")
    with pytest.raises(FileNotFoundError, match="only wandb's run file: .*`wandb sync`"):
        find_logs(tmp_path / "old")
    for name in ("a", "b"):
        (tmp_path / name / ".hydra").mkdir(parents=True)
    with pytest.raises(ValueError, match="holds 2 runs"):
        find_logs(tmp_path)


def viz(*argv: str) -> str:
    """``python -m minigpt.viz *argv`` in this process: its arguments rewritten as the command
    line does, composed with configs/viz.yaml, run; returns what it prints."""
    from hydra import compose, initialize_config_dir

    from minigpt.viz.__main__ import run, viz_arguments

    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("viz", overrides=viz_arguments(list(argv)))
    return run(cfg)


def viz_cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "minigpt.viz", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_command_line_arguments_become_hydra_overrides():
    from minigpt.viz.__main__ import viz_arguments

    assert viz_arguments(["runs", "outputs/a", "out it's/b", "labels=x,y=1", "out=r.png"]) == [
        "command=runs", "out=r.png", "runs=['outputs/a','out it\\'s/b']", "labels=['x','y=1']"]
    assert viz_arguments(["attention", "layer=all"]) == ["command=attention", "layer=all"]
    assert viz_arguments(["runs=a,b"]) == ["runs=['a','b']"]


@pytest.mark.parametrize("argv, line", [
    (["atention"], "error: unknown command 'atention': did you mean attention?"),
    (["attention", "--ckpt-path", "x.ckpt"], "error: --ckpt-path: python -m minigpt.viz takes "
     "key=value settings (configs/viz.yaml): write ckpt_path=..."),
    (["attention", "layr=all"], "error: unknown config key layr: did you mean layer?"),
    (["attention", "layer=-1", "dtype=f32", "cpu_speedups=yes"], "error: layer=-1 must be a "
     "layer index (0, 1, ...) or all; cpu_speedups='yes' must be one of auto, false; dtype='f32' "
     "must be one of auto, float32, bfloat16, float16"),
    (["attention", "ckpt_path=a.ckpt", "pretrained=gpt2", "prompt=hi", "prompt_file=p.txt"],
     "error: give ckpt_path or pretrained, not both; give prompt or prompt_file, not both"),
    (["runs"], "error: runs needs run directories: python -m minigpt.viz runs outputs/<run> ..."),
    (["runs", "nowhere"], "error: runs[0]=nowhere does not exist (cwd: "),
])
def test_command_line_errors_are_one_line(tmp_path, argv, line):
    """Bad input through the real command: exit status 2, one line naming the value (and the
    key meant), nothing written."""
    result = viz_cli(*argv, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), lines
    assert list(tmp_path.iterdir()) == []


def test_runs_cli_draws_several_runs_on_one_png(tmp_path):
    from PIL import Image

    dirs = []
    for i, lr in enumerate((1e-3, 3e-4)):
        rows = [{"step": s, "train/loss": 4.0 - lr * 100 * s, "lr": lr, "tokens": 64 * s,
                 "tokens_per_s": 1000.0 + s} for s in range(1, 20)]
        write_csv_log(tmp_path / f"run{i}/metrics.csv", rows + [{"step": 19, "val/loss": 3.5}])
        dirs.append(str(tmp_path / f"run{i}"))
    out = tmp_path / "runs.png"
    printed = viz("runs", *dirs, "labels=lr=1e-3,lr=3e-4", f"out={out}")
    assert "lr=1e-3  step 19  train/loss" in printed and "best val/loss 3.5000" in printed
    with Image.open(out) as image:
        assert image.size == (1600, 480)
    with pytest.raises(ValueError, match="^2 labels for 1 run directories: give one label per "
                       "run$"):
        viz("runs", dirs[0], "labels=a,b", f"out={out}")


def test_attention_cli_on_a_pretrained_directory(tmp_path):
    """--pretrained: a Hugging Face GPT-2 directory (here a tiny random one) and the GPT-2 BPE."""
    tokenizer = pytest.importorskip("minigpt.tokenizer")
    try:
        tokenizer.get_tokenizer("gpt2")
    except tokenizer.TokenizerUnavailableError as e:
        pytest.skip(str(e))
    from PIL import Image

    tiny_gpt(vocab_size=50257, n_layer=3).save_pretrained(str(tmp_path / "gpt2-tiny"))
    out = tmp_path / "layers.png"
    argv = ["attention", f"pretrained={tmp_path / 'gpt2-tiny'}",
            "prompt='Hello world, this is a test.'", f"out={out}"]
    assert "8 tokens, 3 layers, 2 heads" in viz(*argv, "layer=all")
    with Image.open(out) as image:
        assert image.size == tuple(round(v * 100) for v in figure_layout(3, 8)[2:])
    with pytest.raises(ValueError, match="out of range: the model has 3 layers"):
        viz(*argv, "layer=5")


# --- a real short training run -------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
TINY_TRAIN = ["trainer=cpu", "trainer.max_steps=6", "trainer.val_check_interval=3",
              "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1",
              "trainer.enable_progress_bar=false", "sample.max_new_tokens=4", "model.n_layer=2",
              "model.n_head=2", "model.n_embd=32", "model.context_length=32", "data.batch_size=4",
              "data.val_tokens=256"]


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    """Two real `train.py` runs of a tiny model (Hydra compose API, in process): logger=csv and
    logger=wandb (offline). Returns their run summaries."""
    pytest.importorskip("lightning")
    from hydra import compose, initialize_config_dir

    from minigpt.train.run import run

    root = tmp_path_factory.mktemp("runs")
    summaries = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        mp.chdir(root)  # wandb and Lightning write nothing outside the run dirs
        for logger, lr in (("csv", "1e-3"), ("wandb", "3e-3")):
            overrides = [*TINY_TRAIN, f"logger={logger}", f"optim.lr={lr}",
                         f"data_root={root / 'data'}"]
            with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
                cfg = compose("train", overrides=overrides)
            summaries[logger] = run(cfg, run_dir=root / logger)
            if logger == "wandb":  # a process exit would finish the run; here we must
                import wandb

                wandb.finish()
    return summaries


def test_run_logs_of_a_real_training_run_are_read(real_runs):
    """Both loggers write the CSV the plots read; the wandb run logged to wandb as well."""
    from minigpt.viz.run_plots import LR, TOKENS, TOKENS_PER_SEC, TRAIN_LOSS, VAL_LOSS, load_run

    assert (Path(real_runs["wandb"]["run_dir"]) / "wandb" / "run_id").is_file()
    for logger, summary in real_runs.items():
        run = load_run(summary["run_dir"])
        assert run.sources == [Path(summary["run_dir"]) / "csv" / "metrics.csv"], logger
        assert run.get(TRAIN_LOSS) is not None, (logger, run.sources, sorted(run.metrics))
        steps, loss = run.get(TRAIN_LOSS)
        assert steps.tolist() == list(range(1, summary["steps"] + 1))  # optimizer steps done
        assert all(2.0 < v < 6.0 for v in loss)  # about ln(vocab) this early
        val_steps, val = run.get(VAL_LOSS)
        assert len(val) == 2
        assert val[-1] == pytest.approx(summary["val_loss"], rel=1e-6)
        tokens = run.tokens_at(steps)
        assert (tokens > 0).all() and (tokens[1:] > tokens[:-1]).all()
        lr = run.get(LR)[1]
        assert (lr[1:] > lr[:-1]).all()  # warmup
        assert (run.get(TOKENS_PER_SEC)[1] > 0).all()
        assert run.get(TOKENS) is not None


def test_runs_cli_on_real_runs(real_runs, tmp_path):
    from PIL import Image

    out = tmp_path / "runs.png"
    dirs = [real_runs["csv"]["run_dir"], real_runs["wandb"]["run_dir"]]
    printed = viz("runs", *dirs, f"out={out}")
    assert printed.count("best val/loss") == 2
    with Image.open(out) as image:
        assert image.size == (1600, 480)


def test_attention_cli_on_a_real_checkpoint(real_runs, tmp_path):
    from PIL import Image

    out = tmp_path / "heads.png"
    ckpt = real_runs["csv"]["last"]
    assert "24 tokens, 2 layers, 2 heads" in viz(  # characters
        "attention", f"ckpt_path={ckpt}", "prompt='ROMEO:\nO, she doth teach'", "layer=1",
        f"out={out}")
    with Image.open(out) as image:
        assert image.size == tuple(round(v * 100) for v in figure_layout(2, 24)[2:])
    with pytest.raises(ValueError, match="the prompt is 33 tokens; the model sees at most "
                       "context_length=32"):
        viz("attention", f"ckpt_path={ckpt}", "prompt=" + "x" * 33, f"out={out}")


def test_attention_cli_without_a_checkpoint_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="checkpoints_root=outputs does not exist .*give "
                                                "ckpt_path=FILE or pretrained=DIR"):
        viz("attention", f"out={tmp_path / 'x.png'}")
    assert not (tmp_path / "x.png").exists()
