"""Reading checkpoints back (minigpt.checkpoint) and the generate.py entry point: composed with
Hydra's compose API and run in-process, plus a subprocess run for the real command line."""

import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from minigpt.checkpoint import (
    CheckpointError,
    checkpoint_metadata,
    find_latest_checkpoint,
    load_checkpoint,
)
from minigpt.cpu import speed_up_decoding
from minigpt.model import GPT, GPTConfig
from minigpt.tokenizer import get_tokenizer

ROOT = Path(__file__).resolve().parents[1]
CORPUS = "First Citizen:\nBefore we proceed any further, hear me speak.\n"
_spec = importlib.util.spec_from_file_location("generate_cli", ROOT / "generate.py")
generate_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate_cli)


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(vocab_size=64, context_length=32, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab_size, context_length=context_length, n_layer=2,
                         n_head=2, n_embd=32, init_std=0.5)).eval()


def save_checkpoint(path, model, tokenizer, **meta_overrides):
    """A checkpoint in the documented format (2), as the training loop writes its model part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {**checkpoint_metadata(model.config.to_dict(), tokenizer.to_dict()), **meta_overrides}
    torch.save({"model": {"model." + k: v for k, v in model.state_dict().items()},
                "minigpt": meta, "global_step": 7}, path)
    return path


@pytest.fixture
def char_ckpt(tmp_path):
    tokenizer = get_tokenizer("char", text=CORPUS)  # 28 ids; the model's vocab is padded to 64
    model = tiny_model()
    return save_checkpoint(tmp_path / "outputs" / "run" / "checkpoints" / "last.ckpt", model,
                           tokenizer), model, tokenizer


def config(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("generate", overrides=list(overrides))


def run(*overrides):
    out = io.StringIO()
    samples = generate_cli.run(config(*overrides), out=out)
    return samples, out.getvalue()


# ---- minigpt.checkpoint ---------------------------------------------------------------------

def test_load_checkpoint_round_trip(char_ckpt):
    path, model, tokenizer = char_ckpt
    loaded, loaded_tokenizer, meta = load_checkpoint(path)
    assert loaded.config == model.config and not loaded.training
    idx = torch.randint(0, 64, (2, 10))
    torch.testing.assert_close(loaded(idx), model(idx), rtol=0, atol=0)
    assert loaded_tokenizer.to_dict() == tokenizer.to_dict()
    assert meta["format_version"] == 2


def test_missing_checkpoint_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*nope\.ckpt"):
        load_checkpoint(tmp_path / "nope.ckpt")


def test_not_a_minigpt_checkpoint(tmp_path):
    torch.save({"state_dict": {"layer.weight": torch.zeros(2)}}, tmp_path / "other.ckpt")
    with pytest.raises(CheckpointError, match=r"other\.ckpt is not a minigpt checkpoint"):
        load_checkpoint(tmp_path / "other.ckpt")
    (tmp_path / "junk.ckpt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match=r"junk\.ckpt is not a readable checkpoint"):
        load_checkpoint(tmp_path / "junk.ckpt")


class NotWeights:  # pickled as a class reference: weights_only loading must refuse it
    pass


def test_checkpoint_with_code_is_refused(tmp_path):
    torch.save({"minigpt": {"format_version": 1}, "payload": NotWeights()}, tmp_path / "x.ckpt")
    with pytest.raises(CheckpointError, match="holds Python objects besides tensors") as error:
        load_checkpoint(tmp_path / "x.ckpt")
    assert "weights_only=False" not in str(error.value)  # no unsafe advice for a foreign file


def test_incompatible_format_version(tmp_path):
    model, tokenizer = tiny_model(), get_tokenizer("char", text=CORPUS)
    path = save_checkpoint(tmp_path / "old.ckpt", model, tokenizer, format_version=99)
    with pytest.raises(CheckpointError,
                       match=r"format_version=99 .*this minigpt reads format_version 1 or 2: "
                             r"upgrade minigpt"):
        load_checkpoint(path)


def test_find_latest_checkpoint_by_mtime(tmp_path):
    paths = []
    for i, run_dir in enumerate(["b/1", "a/2", "c/3"]):
        p = tmp_path / run_dir / "checkpoints" / "last.ckpt"
        p.parent.mkdir(parents=True)
        p.write_bytes(b"")
        os.utime(p, (1000 + i, [3000, 2000, 1000][i]))
        paths.append(p)
    (tmp_path / "b/1/checkpoints/epoch=1.ckpt").write_bytes(b"")  # not a last.ckpt: ignored
    assert find_latest_checkpoint(tmp_path) == paths[0]


def test_no_checkpoint_found_says_where_it_looked(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"looked for last\.ckpt under {tmp_path}"):
        find_latest_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"under .*missing \(which does not exist\)"):
        find_latest_checkpoint(tmp_path / "missing")


# ---- generate.py ----------------------------------------------------------------------------

def test_greedy_sample_matches_the_library(char_ckpt):
    path, model, tokenizer = char_ckpt
    ids = model.generate(torch.tensor([tokenizer.encode("First")]), 30, temperature=0,
                         vocab_size=tokenizer.vocab_size)[0].tolist()
    for speedups in ("false", "auto"):  # auto: same weights in oneDNN's layout, same tokens here
        samples, printed = run(f"ckpt_path={path}", "prompt=First", "temperature=0",
                               "max_new_tokens=30", "stop_at_eot=false", "dtype=float32",
                               f"cpu_speedups={speedups}")
        assert samples == [tokenizer.decode(ids)]
        assert printed == samples[0] + "\n"  # streamed (one sample), same text


def test_compiled_decoder_gives_the_eager_samples(char_ckpt, capsys):
    """``decoder=compiled`` (the GPU default: fixed-shape caches in one compiled step) samples
    what the eager decoder samples, greedy and seeded, with the prompt's window crops."""
    path, _, _ = char_ckpt
    for args in (("temperature=0",), ("seed=3", "top_k=5", "num_samples=2")):
        # In float32 both agree exactly; bf16 weights (dtype=auto on a GPU or a CPU with native
        # bf16) round differently in the two (test_static_decoding covers CUDA graphs).
        args = (f"ckpt_path={path}", "device=cpu", "dtype=float32", "prompt=First",
                "max_new_tokens=45", "stop_at_eot=false", *args)
        assert run(*args, "decoder=compiled")[0] == run(*args, "decoder=eager")[0]
    err = capsys.readouterr().err
    # float32 on the CPU: only layouts the compiled step can trace (the row-sum weights)
    compiled = [line for line in err.splitlines() if "compiled decoder; cpu speedups: " in line]
    assert compiled and not any("oneDNN-packed" in line for line in compiled)


def test_newest_checkpoint_is_the_default(char_ckpt, monkeypatch):
    path, _, _ = char_ckpt
    monkeypatch.chdir(path.parents[3])  # the folder holding outputs/
    samples, _ = run("prompt=hear", "max_new_tokens=20", "temperature=0")
    assert samples == run(f"ckpt_path={path}", "prompt=hear", "max_new_tokens=20",
                          "temperature=0")[0]


def test_seeded_samples_reproducible_streamed_or_not(char_ckpt):
    path, _, tokenizer = char_ckpt
    args = (f"ckpt_path={path}", "prompt=Be", "max_new_tokens=40", "seed=3", "top_p=0.9")
    streamed, printed = run(*args)
    again, _ = run(*args, "stream=false")
    assert streamed == again and printed == streamed[0] + "\n"
    many, printed = run(*args, "num_samples=3", "temperature=1.5")
    assert len(many) == 3 and len(set(many)) > 1
    assert printed == generate_cli.SEPARATOR.join(many) + "\n"


def test_padded_vocabulary_never_sampled(char_ckpt):
    path, model, tokenizer = char_ckpt
    with torch.no_grad():
        model.lm_head.weight[tokenizer.vocab_size:] *= 50  # padding ids dominate the logits
    save_checkpoint(path, model, tokenizer)
    # decoding an id >= 28 would raise in the char tokenizer
    samples, _ = run(f"ckpt_path={path}", "max_new_tokens=60", "temperature=2.0",
                     "stop_at_eot=false")
    assert samples[0]


def test_stops_at_end_of_text(char_ckpt):
    path, model, tokenizer = char_ckpt
    with torch.no_grad():  # make end-of-text the likeliest next token after anything
        model.lm_head.weight[tokenizer.eot_id] = model.final_norm.bias.new_full((32,), 0.0)
        model.final_norm.weight.zero_()
        model.final_norm.bias.fill_(1.0)
        model.lm_head.weight[tokenizer.eot_id] = 5.0
    save_checkpoint(path, model, tokenizer)
    samples, printed = run(f"ckpt_path={path}", "prompt=hear", "temperature=0")
    assert samples == ["hear"] and printed == "hear\n"


def test_prompt_from_file(char_ckpt, tmp_path):
    path, _, _ = char_ckpt
    (tmp_path / "p.txt").write_text("speak.\nhear")
    for arg in (f"prompt=@{tmp_path / 'p.txt'}", f"prompt_file={tmp_path / 'p.txt'}"):
        samples, _ = run(f"ckpt_path={path}", arg, "max_new_tokens=3")
        assert samples[0].startswith("speak.\nhear") and len(samples[0]) <= 14


@pytest.mark.parametrize("decoder", ["eager", "compiled"])
def test_prompts_file_is_one_padded_batch_equal_to_each_prompt_alone(char_ckpt, tmp_path,
                                                                     decoder):
    """``prompts=@file.txt``: one prompt per line (blank lines skipped), sampled as one
    left-padded batch; greedy, each sample is what its prompt gives alone, printed after it."""
    path, _, _ = char_ckpt
    lines = ["First", "hear me speak " * 3, "Be"]  # 42 characters: cropped to the context, 32
    (tmp_path / "prompts.txt").write_text("\n".join([lines[0], "", *lines[1:]]) + "\n")
    args = (f"ckpt_path={path}", "device=cpu", "temperature=0", "max_new_tokens=30",
            "stop_at_eot=false", f"decoder={decoder}")
    samples, printed = run(*args, f"prompts=@{tmp_path / 'prompts.txt'}")
    alone = [run(*args, f"prompt='{line}'")[0][0] for line in lines]
    assert samples == alone
    assert all(s.startswith(line) and len(s) > len(line) for s, line in zip(samples, lines, strict=True))
    assert printed == generate_cli.SEPARATOR.join(samples) + "\n"


def test_prompts_file_with_several_samples_each(char_ckpt, tmp_path):
    path, _, _ = char_ckpt
    (tmp_path / "prompts.txt").write_text("First\nBe\n\n")
    samples, _ = run(f"ckpt_path={path}", f"prompts=@{tmp_path / 'prompts.txt'}",
                     "num_samples=2", "max_new_tokens=10", "seed=3")
    assert [s[:2] for s in samples] == ["Fi", "Fi", "Be", "Be"]  # grouped by prompt


def test_empty_prompts_file_is_an_error(char_ckpt, tmp_path):
    path, _, _ = char_ckpt
    (tmp_path / "prompts.txt").write_text("\n  \n")
    with pytest.raises(ValueError, match=r"prompts\.txt holds no prompt; write one prompt per"):
        run(f"ckpt_path={path}", f"prompts=@{tmp_path / 'prompts.txt'}")


def test_long_prompt_is_cropped(char_ckpt, capsys):
    path, _, _ = char_ckpt
    prompt = "hear me speak " * 5  # 70 characters, context_length 32
    samples, _ = run(f"ckpt_path={path}", f"prompt='{prompt}'", "max_new_tokens=50")
    assert samples[0].startswith(prompt)
    assert "conditioning on the last 32" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (["prompt='hear Zoë'"], ValueError, r"2 character\(s\) not in .*vocabulary.*'Z', 'ë'"),
        (["top_p=1.5"], ValueError, r"top_p=1\.5 must be in \(0, 1\]"),
        (["temperature=-0.1"], ValueError, r"temperature=-0\.1 must be >= 0"),
        (["top_k=0"], ValueError, r"top_k=0 must be an integer >= 1"),
        (["num_samples=0", "dtype=float8"], ValueError, r"num_samples=0 .*dtype='float8'"),
        (["decoder=static"], ValueError, r"decoder='static' must be one of auto, eager, compiled"),
        (["prompt=@missing.txt"], FileNotFoundError, r"prompt=@missing\.txt does not exist"),
        (["prompts=@missing.txt"], FileNotFoundError, r"prompts=@missing\.txt does not exist"),
        (["prompts=hear"], ValueError, r"prompts='hear' must name a file, prompts=@path"),
        (["prompt=hear", "prompts=@p.txt"], ValueError, "give one of prompt, prompt_file and "),
        (["prompts=@p.txt", "attention_map=x.png"], ValueError, "attention_map draws one prompt"),
    ],
)
def test_bad_input_errors(char_ckpt, overrides, error, match):
    path, _, _ = char_ckpt
    with pytest.raises(error, match=match):
        run(f"ckpt_path={path}", *overrides)


def test_attention_map_alongside_the_sample(char_ckpt, tmp_path, capsys):
    from PIL import Image

    from minigpt.viz.attention_maps import write_attention_map

    path, model, tokenizer = char_ckpt
    png = tmp_path / "heads.png"
    samples, _ = run(f"ckpt_path={path}", "prompt='hear me speak'", f"attention_map={png}",
                     "attention_layer=1", "max_new_tokens=5", "temperature=0")
    assert samples[0].startswith("hear me speak") and len(samples[0]) == len("hear me speak") + 5
    assert "wrote" in capsys.readouterr().err
    # The grid the viz command draws for layer 1 of this model over the 13 prompt tokens.
    expected = write_attention_map(model, tokenizer, tokenizer.encode("hear me speak"),
                                   tmp_path / "expected.png", 1)
    assert "13 tokens, 2 layers, 2 heads" in expected
    with Image.open(png) as image, Image.open(tmp_path / "expected.png") as reference:
        assert image.size == reference.size and image.size[0] > 100


@pytest.mark.parametrize("overrides, match", [
    (["prompt=''", "attention_map=x.png"], "attention_map needs a prompt"),
    (["prompt=to", "attention_map=x.png", "attention_layer=5"], "layer=5 is out of range"),
])
def test_attention_map_errors(char_ckpt, tmp_path, monkeypatch, overrides, match):
    monkeypatch.chdir(tmp_path)
    path, _, _ = char_ckpt
    with pytest.raises(ValueError, match=match):
        run(f"ckpt_path={path}", *overrides)
    assert not (tmp_path / "x.png").exists()


def test_incompatible_checkpoint_error(char_ckpt):
    path, model, tokenizer = char_ckpt
    save_checkpoint(path, model, tokenizer, format_version=3)
    with pytest.raises(CheckpointError, match="format_version=3"):
        run(f"ckpt_path={path}")


def test_no_checkpoint_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"looked for last\.ckpt under {tmp_path}"):
        run(f"checkpoints_root={tmp_path}")


def test_pretrained_hugging_face_directory(tmp_path):
    pytest.importorskip("safetensors")
    model = tiny_model(vocab_size=50257, context_length=64)
    model.save_pretrained(str(tmp_path / "hf"))
    tokenizer = get_tokenizer("gpt2")
    samples, _ = run(f"pretrained={tmp_path / 'hf'}", "prompt=Hello world", "temperature=0",
                     "max_new_tokens=8", "stop_at_eot=false", "dtype=bfloat16")
    # What generate.py does on the CPU: bfloat16 weights, float32 activations (or plain bf16).
    if not speed_up_decoding(model, torch.bfloat16):
        model = model.to(torch.bfloat16)
    ids = model.generate(torch.tensor([tokenizer.encode("Hello world")]), 8,
                         temperature=0)[0].tolist()
    assert samples == [tokenizer.decode(ids)]


def test_command_line_writes_no_files_and_errors_in_one_line(char_ckpt, tmp_path):
    path, _, _ = char_ckpt
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "generate.py"), f"ckpt_path={path}", "max_new_tokens=5",
           "prompt=hear", "temperature=0"]
    ok = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("hear") and "0.03M parameters" in ok.stderr
    assert list(work.iterdir()) == []  # no outputs/, .hydra/ or log files
    bad = subprocess.run(cmd + ["top_p=2"], cwd=work, capture_output=True, text=True, env=env,
                         timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.splitlines() == ["error: top_p=2.0 must be in (0, 1] (or null for no limit)"]


def test_train_then_generate(tmp_path, monkeypatch):
    """train.py's runner writes outputs/<run>/checkpoints/last.ckpt; generate.py finds and uses
    it with no arguments (a few optimizer steps of the toy char model)."""
    from minigpt.data import prepare_dataset
    from minigpt.train.run import run as train

    overrides = [
        "model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.context_length=32",
        "data.batch_size=4", "data.val_tokens=128", "trainer=cpu", "trainer.max_steps=3",
        "trainer.val_check_interval=3", "trainer.enable_progress_bar=false",
        "trainer.precision=32-true", "logger=none", "sample.max_new_tokens=0",
        f"data_root={tmp_path / 'data'}",
    ]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        train_cfg = compose("train", overrides=overrides)
    prepare_dataset(train_cfg.data, tmp_path / "data", progress=False)
    summary = train(train_cfg, run_dir=tmp_path / "outputs" / "run")
    monkeypatch.chdir(tmp_path)
    samples, printed = run("prompt=ROMEO:", "max_new_tokens=20", "seed=1")
    assert samples[0].startswith("ROMEO:") and printed == samples[0] + "\n"
    model, tokenizer, _ = load_checkpoint(summary["last"])
    assert tokenizer.name == "char" and model.config.context_length == 32
