"""minigpt.devices and minigpt.inference: one dtype rule for training and inference (tested with
the hardware's capabilities as inputs), one device check, one loader for generate, eval and viz."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minigpt import devices
from minigpt.checkpoint import checkpoint_metadata
from minigpt.devices import check_device, inference_dtype, preferred_dtype
from minigpt.errors import UserError
from minigpt.inference import load_for_inference
from minigpt.model import GPT, GPTConfig
from minigpt.tokenizer import get_tokenizer
from minigpt.train.device import default_precision

ROOT = Path(__file__).resolve().parents[1]
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# The hardware a rule must serve, and what it should compute in (the table).
MACHINES = [
    # (device type, multiplies bf16 natively, dtype, example)
    ("cuda", True, BF16, "A100, H100"),
    ("cuda", False, FP16, "V100, T4: bf16 only emulated"),
    ("cpu", True, BF16, "AMX or AVX512-BF16"),
    ("cpu", False, FP32, "other CPUs"),
    ("mps", False, FP32, "Apple GPUs"),
]


@pytest.mark.parametrize(("device_type", "native", "dtype", "example"), MACHINES)
def test_the_rule_per_machine(device_type, native, dtype, example):
    assert preferred_dtype(device_type, native) == dtype, example


def fake_machine(monkeypatch, *, gpu_bf16: bool | None, cpu_bf16: bool) -> None:
    """This process sees a machine whose GPU (None: none) and CPU have these capabilities."""
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: cpu_bf16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu_bf16 is not None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: int(gpu_bf16 is not None))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: bool(gpu_bf16) or including_emulation)


@pytest.mark.parametrize("gpu_bf16", [True, False, None])
@pytest.mark.parametrize("cpu_bf16", [True, False])
def test_dtype_auto_is_what_training_computes_in_on_every_machine(monkeypatch, gpu_bf16,
                                                                  cpu_bf16):
    """generate/eval/viz's ``dtype=auto`` and training's default precision agree on each
    device of each machine (the V100 among them: fp16 for both, where eval once picked bf16)."""
    fake_machine(monkeypatch, gpu_bf16=gpu_bf16, cpu_bf16=cpu_bf16)
    mixed = {BF16: "bf16-mixed", FP16: "16-mixed", FP32: "32-true"}
    expected_cpu = BF16 if cpu_bf16 else FP32
    assert inference_dtype("auto", "cpu") == expected_cpu
    assert default_precision("cpu") == mixed[expected_cpu]
    if gpu_bf16 is not None:
        expected_gpu = BF16 if gpu_bf16 else FP16
        assert check_device("auto") == "cuda"
        assert inference_dtype("auto", "cuda:0") == expected_gpu
        assert default_precision("gpu") == mixed[expected_gpu]
    else:
        assert check_device("auto") == "cpu" and default_precision("gpu") == "32-true"
    assert inference_dtype("float32", "cuda") == FP32  # one option away, on any machine
    assert inference_dtype("float16", "cpu") == FP16


def test_a_bad_dtype_or_device_is_one_line_naming_it(monkeypatch):
    with pytest.raises(UserError, match=r"dtype='float64' must be one of \('auto', 'float32'"):
        inference_dtype("float64", "cpu")
    fake_machine(monkeypatch, gpu_bf16=None, cpu_bf16=False)
    with pytest.raises(UserError, match="device='banana' is not a device name; this machine "
                                        "offers device=cpu"):
        check_device("banana")
    with pytest.raises(UserError, match="device='cuda' is not on this machine, which has no "
                                        "CUDA GPU"):
        check_device("cuda")
    assert check_device("cpu") == "cpu"


@pytest.fixture
def char_ckpt(tmp_path):
    tokenizer = get_tokenizer("char", text="to be or not to be")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, context_length=16, n_layer=2, n_head=2, n_embd=32))
    meta = checkpoint_metadata(model.config.to_dict(), tokenizer.to_dict())
    path = tmp_path / "last.ckpt"
    torch.save({"model": {"model." + k: v for k, v in model.state_dict().items()},
                "minigpt": meta}, path)
    return path, model.eval()


def test_the_loader_places_the_weights_in_the_dtype(char_ckpt):
    path, model = char_ckpt
    idx = torch.tensor([[1, 2, 3, 4, 5]])
    loaded = load_for_inference(path, device="cpu", dtype="bfloat16")
    assert loaded.dtype == BF16 and loaded.device == "cpu"
    assert loaded.place(cpu_speedups=False) == []
    assert loaded.model.lm_head.weight.dtype == BF16
    reference = GPT(model.config).eval()  # the independent way: the model cast by hand
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(idx), reference.to(BF16)(idx), rtol=0, atol=0)
    kept = load_for_inference(path, device="cpu", dtype="bfloat16")
    kept.place(cast_weights=False)  # eval: float32 weights, computing under autocast
    assert kept.model.lm_head.weight.dtype == FP32
    with torch.no_grad(), kept.autocast():
        assert kept.model(idx).dtype == BF16
    assert "cpu bfloat16" in kept.describe() and str(path) in kept.describe()


def test_the_device_is_checked_before_the_file_is_read(tmp_path):
    with pytest.raises(UserError, match="device='banana'"):
        load_for_inference(tmp_path / "missing.ckpt", device="banana")


def cli(*command: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env,
                          timeout=180, cwd=ROOT)


@pytest.mark.parametrize("device, message", [
    ("banana", "device='banana' is not a device name; this machine offers device=cpu"),
    ("cuda:99", "device='cuda:99' is not on this machine"),
])
def test_every_command_line_checks_the_device_the_same_way(char_ckpt, device, message):
    path, _ = char_ckpt
    commands = [
        ["generate.py", f"ckpt_path={path}", f"device={device}"],
        ["-m", "minigpt.eval", f"ckpt_path={path}", f"device={device}"],
        ["-m", "minigpt.viz", "attention", f"ckpt_path={path}", f"device={device}"],
    ]
    for command in commands:
        result = cli(*command)
        lines = result.stderr.splitlines()
        assert result.returncode == 2, (command, result.stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), (command, lines)


@pytest.mark.parametrize("device", ["banana", "cuda:99"])
def test_the_harness_model_checks_the_device_as_generate_does(char_ckpt, device):
    """lm-eval builds ``MiniGPTLM`` from its own argument string (``--model minigpt``): the
    same one line as ``python generate.py device=...``."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.registry import get_model

    import minigpt.eval.harness  # noqa: F401 (registers the model "minigpt")

    path, _ = char_ckpt
    generate = cli("generate.py", f"ckpt_path={path}", f"device={device}")
    assert generate.returncode == 2, generate.stderr[-2000:]
    with pytest.raises(UserError) as error:
        get_model("minigpt").create_from_arg_string(f"ckpt_path={path},device={device}")
    assert [f"error: {error.value}"] == generate.stderr.splitlines()


def test_the_harness_model_loads_in_the_shared_dtype_rule(char_ckpt):
    """``MiniGPTLM(ckpt_path=...)``: float32 weights on the device, forward passes in the dtype
    ``dtype=auto`` means for generate and eval on this machine (``inference_dtype``)."""
    pytest.importorskip("lm_eval")
    from minigpt.eval.harness import MiniGPTLM

    path, model = char_ckpt
    lm = MiniGPTLM(ckpt_path=path, device="cpu")
    assert lm.model.lm_head.weight.dtype == FP32 and lm.device_ == "cpu"
    torch.testing.assert_close(lm.model.lm_head.weight, model.lm_head.weight)
    expected = inference_dtype("auto", "cpu")
    if expected == FP32:
        assert lm.autocast is None
    else:
        with lm.autocast():
            assert torch.get_autocast_dtype("cpu") == expected and torch.is_autocast_enabled("cpu")
    assert MiniGPTLM(ckpt_path=path, device="cpu", dtype="float32").autocast is None
    with MiniGPTLM(ckpt_path=path, device="cpu", dtype="bfloat16").autocast():
        assert torch.get_autocast_dtype("cpu") == BF16
