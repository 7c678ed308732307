"""Training: pure helpers with numbers, then real (tiny) runs of the composed Hydra config:
end to end, exact resume, SIGTERM / Ctrl-C checkpoints, fine-tuning sources, bad overrides,
and a 2-process CPU DDP run of ``python train.py`` in a subprocess."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from minigpt.checkpoint import CheckpointError, is_sharded_checkpoint, load_checkpoint
from minigpt.config import TrainSchema, typed
from minigpt.errors import ConfigError, UserError
from minigpt.model import GPT, GPTConfig
from minigpt.tokenizer import get_tokenizer
from minigpt.train.loggers import _wandb_logged_in, build_loggers
from minigpt.train.model_init import init_model, padded_vocab_size
from minigpt.train.optim import lr_at
from minigpt.train.run import resolve_ckpt_path, run

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.context_length=32",
    "data.batch_size=4", "data.val_tokens=256", "trainer=cpu", "trainer.max_steps=8",
    "trainer.val_check_interval=4", "trainer.enable_progress_bar=false",
    "trainer.precision=32-true", "trainer.log_every_n_steps=1", "logger=none",
    "optim.warmup_steps=2", "optim.lr=0.01", "sample.max_new_tokens=8",
]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """shakespeare_char prepared once into a temporary data root (~1 s)."""
    from minigpt.data import prepare_dataset

    root = tmp_path_factory.mktemp("data")
    cfg = tiny_cfg(root)
    prepare_dataset(cfg.data, root, progress=False)
    return root


def tiny_cfg(data_root: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=[*TINY, f"data_root={data_root}", *overrides])


class LossRecorder:
    """Each optimizer step's loss (a Fabric callback; reading it back is the test's business)."""

    def __init__(self):
        self.losses: dict[int, float] = {}

    def on_train_step_end(self, loop, loss):
        self.losses[loop.progress.global_step] = float(loss)


class SignalAt:
    """Sends ``signum`` to this process after optimizer step ``step``."""

    def __init__(self, step: int, signum: int):
        self.step, self.signum = step, signum

    def on_train_step_end(self, loop, loss):
        if loop.progress.global_step == self.step:
            os.kill(os.getpid(), self.signum)


# ---- pure helpers ----------------------------------------------------------------------------

def test_vocab_padding_and_pinning():
    assert padded_vocab_size(81, None) == 128
    assert padded_vocab_size(50257, None) == 50304
    assert padded_vocab_size(81, 100) == 100
    with pytest.raises(ConfigError, match=r"model.vocab_size=50 is smaller .* \(81\)"):
        padded_vocab_size(81, 50)


def test_resolve_ckpt_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint found"):
        resolve_ckpt_path("last", tmp_path / "outputs")
    old, new = tmp_path / "outputs/a/checkpoints/last.ckpt", tmp_path / "outputs/b/checkpoints/last.ckpt"
    for i, p in enumerate((old, new)):
        p.parent.mkdir(parents=True)
        p.write_bytes(b"x")
        os.utime(p, (1000 + i, 1000 + i))
    assert resolve_ckpt_path("last", tmp_path / "outputs") == str(new)
    assert resolve_ckpt_path(str(old), tmp_path) == str(old)
    assert resolve_ckpt_path(None, tmp_path) is None
    with pytest.raises(FileNotFoundError, match="nope.ckpt"):
        resolve_ckpt_path(str(tmp_path / "nope.ckpt"), tmp_path)


def test_wandb_login_detection_and_fallback(tmp_path, monkeypatch, data_root):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    assert not _wandb_logged_in()
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password abc\n")
    (tmp_path / "netrc").chmod(0o600)
    assert _wandb_logged_in()
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("NETRC", str(tmp_path / "missing"))
    assert _wandb_logged_in()

    import wandb

    def broken(*args, **kwargs):
        raise RuntimeError("no wandb here")

    monkeypatch.setattr(wandb, "init", broken)
    cfg = tiny_cfg(data_root, "logger=wandb")
    loggers = build_loggers(typed(cfg, TrainSchema).logger, tmp_path)
    with pytest.warns(UserWarning, match="wandb could not start.*no wandb here"):
        assert loggers[1].start({}) is None
    loggers[1].log_metrics({"x": 1.0}, step=1)  # inert: the CSV log still has everything
    assert [type(lg).__name__ for lg in loggers] == ["ContinuedCSV", "WandbRun"]


def test_cpu_speedups_and_keep_freed_memory_on_cpu_runs_only(data_root, monkeypatch):
    import minigpt.train.run
    from minigpt.train.plan import resolve_plan
    from minigpt.train.run import apply_cpu_speedups

    calls = []
    monkeypatch.setattr(minigpt.train.run, "speed_up_training",
                        lambda *a, **k: calls.append(k) or [])
    model = GPT(GPTConfig(vocab_size=64, context_length=8, n_layer=1, n_head=2, n_embd=16))
    def plan(*overrides):
        return resolve_plan(typed(tiny_cfg(data_root, *overrides), TrainSchema), world_size=1)

    gpu = plan("trainer.accelerator=gpu")
    assert not gpu.cpu_speedups and apply_cpu_speedups(model, gpu) == []
    assert calls == []  # a GPU rank keeps glibc's default allocator and the plain loss
    apply_cpu_speedups(model, plan("compile=true"))
    assert calls == [{"precision": "32-true", "compiled": True}]
    off = plan("cpu_speedups=false")
    assert not off.cpu_speedups and not off.chunked_loss


# ---- real runs -------------------------------------------------------------------------------

def test_end_to_end_run_writes_checkpoints_metrics_and_samples(tmp_path, data_root):
    summary = run(tiny_cfg(data_root, "logger=csv", "peak_flops=1e12"), run_dir=tmp_path / "run")
    run_dir = Path(summary["run_dir"])
    assert summary["steps"] == 8 and math.isfinite(summary["val_loss"])
    assert summary["val_loss"] < math.log(81)  # learned something beyond uniform
    assert summary["last"].endswith("checkpoints/last.ckpt")
    assert Path(summary["best"]).name == "best.ckpt"
    assert (run_dir / "config.yaml").is_file() and (run_dir / "samples.txt").read_text()
    assert json.loads((run_dir / "summary.json").read_text()) == summary

    rows = list(csv.DictReader((run_dir / "csv" / "metrics.csv").open()))
    for name in ("train/loss", "val/loss", "val/ppl", "val/bpb", "lr", "tokens", "tokens_per_s",
                 "grad_norm", "mfu"):
        assert name in rows[0]
    val = [r for r in rows if r["val/loss"]][-1]
    loss = float(val["val/loss"])
    assert loss == pytest.approx(summary["val_loss"])
    assert float(val["val/ppl"]) == pytest.approx(math.exp(loss), rel=1e-5)
    # characters are 1 byte, except a few like the em dash (3 bytes): bpb a bit under loss/ln 2
    assert 0.9 < loss / math.log(2) / float(val["val/bpb"]) < 1.1
    train = [r for r in rows if r["tokens"]]
    assert [float(r["tokens"]) for r in train[:2]] == [4 * 32, 8 * 32]  # batch 4 x 32 tokens
    # the lr each step used: step k (1-based) ran with lr_at(k - 1)
    lrs = [float(r["lr"]) for r in train]
    assert lrs == pytest.approx([lr_at(k, 0.01, 2e-4, 2, 8) for k in range(8)], rel=1e-5)

    # The whole checkpoint is weights_only-safe, with clean keys and our metadata.
    ckpt = torch.load(summary["last"], weights_only=True)
    assert ckpt["global_step"] == 8 and ckpt["minigpt"]["format_version"] == 2
    assert all(k.startswith("model.") and "_orig_mod" not in k for k in ckpt["model"])
    assert ckpt["minigpt"]["model_config"]["vocab_size"] == 128  # 81 padded to 64s
    assert {"optimizer", "schedulers", "data", "rng_states", "best_val_loss"} <= set(ckpt)
    assert ckpt["data"]["batches_consumed"] == 8
    model, tokenizer, meta = load_checkpoint(summary["last"])
    assert tokenizer.vocab_size == 81 and model.config.n_embd == 32


def test_exact_resume_matches_uninterrupted_run(tmp_path, data_root):
    # dropout > 0 so the restored RNG states matter; decay_steps pinned so the half run has the
    # same LR schedule as the full one.
    common = ["model.dropout=0.1", "optim.decay_steps=8"]
    straight, first, second = LossRecorder(), LossRecorder(), LossRecorder()
    full = run(tiny_cfg(data_root, *common), tmp_path / "full", callbacks=[straight])
    half = run(tiny_cfg(data_root, *common, "trainer.max_steps=4"), tmp_path / "half",
               callbacks=[first])
    resumed = run(tiny_cfg(data_root, *common, f"ckpt_path={half['last']}"), tmp_path / "resumed",
                  callbacks=[second])
    assert list(straight.losses) == list(range(1, 9))
    assert list(second.losses) == [5, 6, 7, 8]
    expect = [straight.losses[s] for s in range(1, 9)]
    got = [first.losses[s] for s in range(1, 5)] + [second.losses[s] for s in range(5, 9)]
    torch.testing.assert_close(got, expect, rtol=1e-6, atol=0)
    assert resumed["val_loss"] == pytest.approx(full["val_loss"], rel=1e-6)
    a = torch.load(full["last"], weights_only=True)["model"]
    b = torch.load(resumed["last"], weights_only=True)["model"]
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-6, atol=1e-7)


def test_compiled_training_resumes_and_generates(tmp_path, data_root):
    """compile=true (what compile=auto picks on GPUs): forward + loss compiled as one function
    trains like the eager model, resumes, and its checkpoint loads in generate.py unchanged."""
    short = ["trainer.max_steps=2", "trainer.val_check_interval=2", "sample.max_new_tokens=4"]
    eager = run(tiny_cfg(data_root, *short), tmp_path / "eager")
    half = run(tiny_cfg(data_root, *short, "compile=true"), tmp_path / "half")
    assert half["val_loss"] == pytest.approx(eager["val_loss"], rel=1e-4)
    resumed = run(tiny_cfg(data_root, "trainer.max_steps=4", "trainer.val_check_interval=2",
                           "sample.max_new_tokens=4", "compile=true", f"ckpt_path={half['last']}"),
                  tmp_path / "resumed")
    assert resumed["steps"] == 4 and math.isfinite(resumed["val_loss"])
    assert (tmp_path / "resumed" / "samples.txt").read_text().count("--- step 4 ---") == 1
    ckpt = torch.load(resumed["last"], weights_only=True)
    assert not [k for k in ckpt["model"] if "_orig_mod" in k]

    generate_cli = _load_generate_cli()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        gen_cfg = compose("generate", overrides=[f"ckpt_path={resumed['last']}", "prompt=ROMEO:",
                                                 "max_new_tokens=5", "stream=false"])
    import io

    samples = generate_cli.run(gen_cfg, out=io.StringIO())
    assert samples[0].startswith("ROMEO:") and len(samples[0]) > len("ROMEO:")


def _load_generate_cli():
    import importlib.util

    spec = importlib.util.spec_from_file_location("generate_cli", ROOT / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_saves_checkpoint_and_exits(tmp_path, data_root, signum, code):
    cfg = tiny_cfg(data_root, "trainer.max_steps=1000", "trainer.val_check_interval=500")
    sigint_before = signal.getsignal(signal.SIGINT)  # SIG_IGN when CI runs us in the background
    with pytest.raises(SystemExit) as exit_info:
        run(cfg, tmp_path / "run", callbacks=[SignalAt(3, signum)])
    assert exit_info.value.code == code
    ckpt = torch.load(tmp_path / "run/checkpoints/last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 3
    assert signal.getsignal(signal.SIGINT) == sigint_before  # handler restored
    assert not list((tmp_path / "run/checkpoints").glob("*.tmp"))


class OutOfMemoryAt:
    """Raises what CUDA raises when a step does not fit, at the first training batch."""

    def on_train_batch_start(self, loop, micro):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_out_of_memory_in_training_is_one_line_with_advice(tmp_path, data_root):
    from minigpt.errors import ResourceError

    with pytest.raises(ResourceError) as error:
        run(tiny_cfg(data_root), tmp_path / "run", callbacks=[OutOfMemoryAt()])
    message = str(error.value)
    assert message.startswith(
        "out of memory during training at step 1 (OutOfMemoryError: CUDA out of")
    assert "data.batch_size=4" in message and "activation_checkpointing" in message
    assert "\n" not in message
    assert "trainer=fsdp" not in message  # one process on the CPU: nothing to shard over


def test_init_from_checkpoint_and_hf_directory(tmp_path, data_root):
    tokenizer = get_tokenizer("char", chars="abc")
    source = GPT(GPTConfig(vocab_size=64, context_length=16, n_layer=1, n_head=2, n_embd=16))
    hf_dir = tmp_path / "hf"
    source.save_pretrained(str(hf_dir))
    with pytest.warns(UserWarning, match="is GPT-2"):
        model = init_model({"init_from": str(hf_dir), "dropout": 0.1, "context_length": 8},
                           tokenizer, 64)
    assert model.config.dropout == 0.1 and model.config.context_length == 8
    torch.testing.assert_close(model.tok_emb.weight, source.tok_emb.weight)

    summary = run(tiny_cfg(data_root, "trainer.max_steps=2"), tmp_path / "run")
    with pytest.raises(ConfigError, match=f"model.init_from={tmp_path / 'run'} is a directory "
                       f"without config.json: .* e.g. model.init_from={summary['last']}$"):
        init_model({"init_from": str(tmp_path / "run")}, tokenizer, 64)
    cfg = tiny_cfg(data_root, f"model.init_from={summary['last']}", "model.n_layer=5")
    char = get_tokenizer("char", chars="abc")
    with pytest.raises(ConfigError, match="trained with tokenizer"):
        init_model(typed(cfg, TrainSchema).model, char, 64)
    trained, data_tokenizer, _ = load_checkpoint(summary["last"])
    model = init_model(typed(cfg, TrainSchema).model, data_tokenizer, 128)
    assert model.config.n_layer == 2  # the checkpoint fixes the architecture
    for (k, v), w in zip(model.state_dict().items(), trained.state_dict().values(), strict=True):
        torch.testing.assert_close(v, w, msg=k)


@pytest.mark.parametrize(("override", "message"), [
    ("optim.lr=-0.001", r"optim.lr=-0.001 must be a positive number"),
    ("data.batch_size=0", r"data.batch_size=0 must be a positive integer"),
    ("trainer.devices=64", r"trainer.devices=64 but this machine has \d+ CPU"),
    ("model.vocab_size=10", r"model.vocab_size=10 is smaller than the tokenizer's vocabulary"),
    ("model.n_embd=33", r"n_embd=33 must be divisible by n_head=2"),
    ("threads=0", r"threads=0 must be a positive integer or null"),
    ("optim.embedding_lr=0", r"optim.embedding_lr=0.0 must be a positive number or null"),
    ("optim.head_lr=0.01", r"optim.head_lr=0.01 needs model.tie_head=false"),
    ("data.tokens_per_step=1000", r"data.tokens_per_step=1000 is not a multiple of data.batch_size "
     r"x context_length x processes = 4 x 32 x 1 = 128; fix: data.tokens_per_step=1024"),
    ("+model.n_layers=3", r"unknown config key model.n_layers: did you mean model.n_layer\?"),
])
def test_bad_overrides_fail_before_training(tmp_path, data_root, override, message):
    with pytest.raises(UserError, match=message):  # ConfigError, or ConfigKeyError for a key
        run(tiny_cfg(data_root, override), tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_several_bad_values_in_one_message(tmp_path, data_root):
    with pytest.raises(ConfigError, match="data.batch_size=0.*optim.lr=-1.*trainer.max_steps=0"):
        run(tiny_cfg(data_root, "optim.lr=-1", "data.batch_size=0", "trainer.max_steps=0"),
            tmp_path / "run")


def test_unknown_model_name_is_a_clear_hydra_error(data_root):
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match=r"(?s)Could not find 'model/gpt5'.*Available options in 'model'.*toy"):
        tiny_cfg(data_root, "model=gpt5")


# ---- subprocesses: the real entry point ------------------------------------------------------

def _train_py(tmp_path, *args, timeout=120, script=ROOT / "train.py"):
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_bad_override_is_one_line(tmp_path, data_root):
    result = _train_py(tmp_path, f"data_root={data_root}", "optim.lr=-1", "logger=none")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: bad config: optim.lr=-1.0 must be a positive number"
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("*.ckpt"))


@pytest.mark.parametrize("recipe", ["gpt2", "modern"])  # modern: compiled blocks, split Muon
def test_ddp_two_cpu_processes(tmp_path, data_root, recipe):
    result = _train_py(
        tmp_path, *TINY, f"data_root={data_root}", "trainer=ddp", "trainer.accelerator=cpu",
        "trainer.devices=2", "trainer.max_steps=4", "trainer.val_check_interval=2",
        "logger=csv", f"recipe={recipe}", timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dirs = [p.parent for p in (tmp_path / "outputs").rglob(".hydra")]
    assert len(run_dirs) == 1, run_dirs  # one output directory for both ranks
    run_dir = run_dirs[0]
    assert [p.name for p in (tmp_path / "outputs").rglob("*.ckpt")] and \
        sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["best.ckpt", "last.ckpt"]
    sums = {}
    for log in run_dir.glob("*.log"):
        for rank, value in re.findall(r"rank (\d): parameter checksum (\S+)", log.read_text()):
            sums[rank] = value
    assert set(sums) == {"0", "1"} and sums["0"] == sums["1"], sums  # the ranks agree
    ckpt = torch.load(run_dir / "checkpoints/last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 4 and len(ckpt["rng_states"]) == 2


class MicroBatchCounter:
    """Micro-batches per optimizer step, and the accumulation the loop ran with."""

    def __init__(self):
        self.per_step: dict[int, int] = {}
        self.accumulate = None

    def on_train_batch_start(self, loop, micro):
        self.accumulate = loop.plan.batch.accumulate
        step = loop.progress.global_step + 1  # the step this micro-batch belongs to
        self.per_step[step] = self.per_step.get(step, 0) + 1


def _csv_tokens(run_dir: Path) -> dict[int, float]:
    rows = csv.DictReader((run_dir / "csv" / "metrics.csv").open())
    return {int(r["step"]): float(r["tokens"]) for r in rows if r["tokens"]}


def test_tokens_per_step_on_2_processes_and_resume_on_another_layout(tmp_path, data_root):
    """data.tokens_per_step=512 with micro-batches of 4 x 32: 2 micro-batches on each of 2 DDP
    processes, 4 in one process; a checkpoint from 2 processes resumes in 1 and the reverse."""
    recipe = [*TINY, f"data_root={data_root}", "data.tokens_per_step=512", "logger=csv",
              "trainer.val_check_interval=1"]  # last.ckpt after every step
    ddp = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]
    two = tmp_path / "two"
    result = _train_py(tmp_path, *recipe, *ddp, "trainer.max_steps=3", f"hydra.run.dir={two}",
                       timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "4 x 32 tokens x 2 micro-batch(es) x 2 process(es) = 512 tokens per step" in out
    assert _csv_tokens(two) == {1: 512, 2: 1024, 3: 1536}  # the logged tokens per step

    # the same command in one process: twice the micro-batches, every step whole after resume
    counter = MicroBatchCounter()
    one = run(tiny_cfg(data_root, "data.tokens_per_step=512", "logger=csv",
                       "trainer.val_check_interval=1", "trainer.max_steps=5",
                       f"ckpt_path={two / 'checkpoints/last.ckpt'}"), tmp_path / "one",
              callbacks=[counter])
    assert counter.accumulate == 4 and counter.per_step == {4: 4, 5: 4}
    assert one["steps"] == 5 and _csv_tokens(tmp_path / "one") == {4: 2048, 5: 2560}
    assert math.isfinite(one["val_loss"])

    back = tmp_path / "back"  # and from 1 process back to 2
    result = _train_py(tmp_path, *recipe, *ddp, "trainer.max_steps=6", f"hydra.run.dir={back}",
                       f"ckpt_path={one['last']}", timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _csv_tokens(back) == {6: 3072}
    assert torch.load(back / "checkpoints/last.ckpt", weights_only=True)["global_step"] == 6


def _fsdp_train_py(tmp_path, data_root, *args):
    return _train_py(
        tmp_path, *TINY, f"data_root={data_root}", "trainer=fsdp", "trainer.accelerator=cpu",
        "trainer.val_check_interval=2", "trainer.precision=bf16-mixed", "logger=csv", *args,
        timeout=180, script=ROOT / "tests" / "train" / "fsdp_cpu_train.py")


def _checksums(run_dir: Path) -> dict[str, str]:
    sums = {}
    for log in run_dir.glob("*.log"):
        for rank, value in re.findall(r"rank (\d): parameter checksum (\S+)", log.read_text()):
            sums[rank] = value
    return sums


def test_fsdp_two_cpu_processes_sharded_checkpoints(tmp_path, data_root):
    """trainer=fsdp through Fabric on 2 CPU processes under bf16-mixed (as on GPUs):
    tests/train/fsdp_cpu_train.py lifts only the device guards that keep Fabric's FSDP on
    GPUs. Samples work; each rank writes its shard; the end of the run (validated and saved at
    step 5) consolidates the model for generate.py; the sharded checkpoint resumes in one
    process."""
    run_dir = tmp_path / "two"
    result = _fsdp_train_py(tmp_path, data_root, "trainer.devices=2", "trainer.max_steps=5",
                            f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "strategy: CPUFSDPStrategy" in out and "samples are off" not in out
    sums = _checksums(run_dir)
    assert set(sums) == {"0", "1"} and sums["0"] == sums["1"], sums  # gathered, the ranks agree
    samples = (run_dir / "samples.txt").read_text()  # sampling gathered the sharded weights
    assert "--- step 2 ---" in samples and "--- step 4 ---" in samples
    ckpt_dir = run_dir / "checkpoints"
    last = ckpt_dir / "last.ckpt"
    assert is_sharded_checkpoint(last)  # its own shards, or a link to best's
    assert torch.load(last / "meta.pt", weights_only=True)["global_step"] == 5
    with pytest.raises(CheckpointError, match="sharded FSDP checkpoint.*consolidate"):
        load_checkpoint(last)
    # The consolidated model file: the trained weights, read by generate.py's loader.
    model, _, _ = load_checkpoint(ckpt_dir / "model.ckpt")
    assert float(sums["0"]) == pytest.approx(
        sum(float(p.detach().double().sum()) for p in model.parameters()), rel=1e-9)
    from minigpt.checkpoint.consolidate import main as checkpoint_cli

    assert checkpoint_cli(["consolidate", str(run_dir), "--out", str(tmp_path / "m.ckpt")]) == 0
    again, _, _ = load_checkpoint(tmp_path / "m.ckpt")
    from minigpt.checkpoint import load_model

    assert load_model(checkpoints_root=run_dir)[2] == str(ckpt_dir / "model.ckpt")  # generate.py
    for a, b in zip(model.parameters(), again.parameters(), strict=True):
        torch.testing.assert_close(a, b)

    one = tmp_path / "one"  # 2 processes' shards resume in 1 (DCP reshards on load)
    result = _fsdp_train_py(tmp_path, data_root, "trainer.devices=1", "trainer.max_steps=6",
                            f"hydra.run.dir={one}", f"ckpt_path={last}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert torch.load(one / "checkpoints/last.ckpt/meta.pt", weights_only=True)["global_step"] == 6


def test_lightning_tips_are_dropped_and_our_messages_kept(caplog):
    import logging

    from lightning.pytorch.utilities import rank_zero_info

    from minigpt.train.run import quiet_warnings

    quiet_warnings()
    with caplog.at_level(logging.INFO):
        rank_zero_info("💡 Tip: For seamless cloud logging, try installing something")
        rank_zero_info("cpu speedups: none apply")
    assert [r.getMessage() for r in caplog.records] == ["cpu speedups: none apply"]


def test_run_id_is_shared_by_the_ranks_of_a_launch(monkeypatch):
    from minigpt.train.run_dir import run_id

    for var in ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)
    assert re.fullmatch(r"\d\d-\d\d-\d\d", run_id())
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert re.fullmatch(r"\d\d-\d\d-\d\d", run_id())  # one task: an interactive job, say
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_STEP_ID", "3")
    assert run_id() == "slurm-42-3"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert run_id() == "torchrun-abc"


def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    from minigpt.train import run_dir as run_dirs

    monkeypatch.setattr(run_dirs, "run_id", lambda: "10-11-12")
    parent = str(tmp_path / "outputs" / "2026-11-25")
    assert run_dirs.claim_run_dir(parent).endswith("/10-11-12")
    assert run_dirs.claim_run_dir(parent).endswith("/10-11-12-2")
    monkeypatch.setattr(run_dirs, "run_id", lambda: "torchrun-abc")  # shared by the ranks
    assert run_dirs.claim_run_dir(parent) == run_dirs.claim_run_dir(parent)


def test_a_new_run_refuses_another_runs_directory_and_a_failed_start_leaves_nothing(
        tmp_path, data_root):
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    (other / "checkpoints" / "last.ckpt").write_bytes(b"theirs")
    (other / "config.yaml").write_text("theirs")
    with pytest.raises(ConfigError, match=r"holds another run's checkpoints \(last.ckpt\); to "
                       r"continue that run add ckpt_path=.*last.ckpt"):
        run(tiny_cfg(data_root), other)
    assert (other / "config.yaml").read_text() == "theirs"  # untouched
    mine = tmp_path / "mine"  # a start that fails after the run wrote its first files
    (mine / ".hydra").mkdir(parents=True)
    (mine / "train.log").write_text("")
    with pytest.raises(ConfigError, match="data.batch_size=0"):
        run(tiny_cfg(data_root, "data.batch_size=0"), mine)
    assert not mine.exists()


def test_two_runs_started_together_end_in_two_complete_directories(tmp_path, data_root):
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [*TINY, f"data_root={data_root}", "trainer.max_steps=2", "trainer.val_check_interval=2"]
    runs = [subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    for process in runs:
        _, err = process.communicate(timeout=180)
        assert process.returncode == 0, err[-2000:]
    dirs = sorted(p.parent for p in (tmp_path / "outputs").rglob("summary.json"))
    assert len(dirs) == 2, dirs
    for run_dir in dirs:
        assert json.loads((run_dir / "summary.json").read_text())["run_dir"] == str(run_dir)
        assert (run_dir / "checkpoints" / "best.ckpt").is_file()


@pytest.mark.parametrize("split_qkv", [False, True])
def test_muon_and_wsd_train_and_resume_exactly_and_report_the_target(tmp_path, data_root,
                                                                      split_qkv):
    common = ["optim=muon", "optim.schedule=wsd", "optim.decay_steps=8", "trainer.max_steps=8",
              "logger=csv", f"optim.muon_split_qkv={split_qkv}",
              "trainer.target_val_loss=10.0"]
    straight, first, second = LossRecorder(), LossRecorder(), LossRecorder()
    full = run(tiny_cfg(data_root, *common), tmp_path / "full", callbacks=[straight])
    assert full["target"]["steps"] == 4 and full["target"]["tokens"] == 4 * 128  # first val
    half = run(tiny_cfg(data_root, *common, "trainer.max_steps=4"), tmp_path / "half",
               callbacks=[first])
    ckpt = torch.load(half["last"], weights_only=True)
    assert {"optimizer", "muon"} <= set(ckpt) and set(ckpt["schedulers"]) == {"optimizer", "muon"}
    run(tiny_cfg(data_root, *common, f"ckpt_path={half['last']}"), tmp_path / "resumed",
        callbacks=[second])
    got = [first.losses[s] for s in range(1, 5)] + [second.losses[s] for s in range(5, 9)]
    torch.testing.assert_close(got, [straight.losses[s] for s in range(1, 9)], rtol=1e-6, atol=0)
    rows = list(csv.DictReader((tmp_path / "full" / "csv" / "metrics.csv").open()))
    assert any(r.get("lr_muon") for r in rows) and any(r.get("target/steps") for r in rows)
    with pytest.raises(ConfigError, match=r"trained with optimizer\(s\) \['muon', 'optimizer'\]"):
        run(tiny_cfg(data_root, "trainer.max_steps=9", f"ckpt_path={full['last']}"),
            tmp_path / "adamw")
    with pytest.raises(ConfigError, match=r"holds optimizer state for other parameters.*"
                       r"optim.muon_split_qkv.*model.init_from="):
        run(tiny_cfg(data_root, *common, "trainer.max_steps=9", f"ckpt_path={full['last']}",
                     f"optim.muon_split_qkv={not split_qkv}"), tmp_path / "other_split")


def test_hellaswag_in_training_reaches_the_csv_log_and_summary(tmp_path, data_root):
    """eval.every=1 on a local HellaSwag-format file (characters of the char tokenizer)."""
    items = tmp_path / "hellaswag.jsonl"
    rows = [{"ctx": "the king is dead and", "endings": ["long live the king.", "the sea is wide.",
                                                         "a horse, a horse.", "to be or not."],
             "label": i % 4} for i in range(6)]
    items.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = run(tiny_cfg(data_root, "logger=csv", "trainer.max_steps=4", "eval.every=1",
                           f"eval.path={items}", "eval.batch_size=4"), tmp_path / "run")
    logged = [r for r in csv.DictReader((tmp_path / "run" / "csv" / "metrics.csv").open())
              if r.get("eval/hellaswag/acc")]
    assert [int(r["step"]) for r in logged] == [4]  # at the one validation
    for key in ("eval/hellaswag/acc", "eval/hellaswag/acc_norm"):
        assert 0.0 <= summary[key] <= 1.0 and float(logged[0][key]) == summary[key]
        assert summary[key] * 6 == round(summary[key] * 6)  # a count of 6 items


def test_a_checkpoint_of_the_lightning_trainer_resumes(tmp_path, data_root, checkpoint_v1):
    """The text fixture (written by Lightning's Trainer at step 3) continues to step 5 and its
    new checkpoint is in today's format."""
    fixture_model = ["model.n_layer=1", "model.n_head=2", "model.n_embd=8",
                     "model.context_length=16", "data.batch_size=2"]
    summary = run(tiny_cfg(data_root, *fixture_model, "trainer.max_steps=5",
                           f"ckpt_path={checkpoint_v1}"), tmp_path / "run")
    assert summary["steps"] == 5 and math.isfinite(summary["val_loss"])
    ckpt = torch.load(summary["last"], weights_only=True)
    assert ckpt["minigpt"]["format_version"] == 2 and ckpt["data"]["batches_consumed"] == 5


def test_a_run_ends_the_process_group_it_started_and_keeps_a_callers(tmp_path, data_root):
    """A gloo group left to interpreter shutdown can abort a finished run (SIGABRT): the run
    destroys the group Fabric started for it, and leaves alone one its caller started."""
    one_process_ddp = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=1",
                       "trainer.max_steps=1", "trainer.val_check_interval=1",
                       "sample.max_new_tokens=0"]
    assert not torch.distributed.is_initialized()
    assert run(tiny_cfg(data_root, *one_process_ddp), tmp_path / "own")["steps"] == 1
    assert not torch.distributed.is_initialized()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=0, world_size=1)
    try:
        assert run(tiny_cfg(data_root, *one_process_ddp), tmp_path / "callers")["steps"] == 1
        assert torch.distributed.is_initialized()
    finally:
        torch.distributed.destroy_process_group()
