"""minigpt.train.device: precision per device (minigpt.devices' rule), compile on GPUs."""

import torch

from minigpt import devices
from minigpt.train.device import (
    compile_enabled,
    default_precision,
    fsdp_mixed_precision,
    resolve_accelerator,
)


def test_default_precision(monkeypatch):
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: True)
    assert default_precision("cpu") == "bf16-mixed"
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: False)
    assert default_precision("cpu") == "32-true"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_precision("gpu") == "32-true"
    assert default_precision("auto") == "32-true"


def test_resolve_accelerator(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_accelerator("auto") == "cpu" and resolve_accelerator(None) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_accelerator("auto") == "gpu" and resolve_accelerator("cuda") == "gpu"
    assert resolve_accelerator("cpu") == "cpu"


def test_gpus_without_native_bf16_train_in_fp16(monkeypatch):
    """V100/T4 emulate bf16 (torch.cuda.is_bf16_supported() says True): they get 16-mixed."""
    asked = []

    def bf16_supported(including_emulation=True):
        asked.append(including_emulation)
        return including_emulation  # emulation only, as a V100

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", bf16_supported)
    assert default_precision("gpu") == "16-mixed" and asked == [False]
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert default_precision("gpu") == "bf16-mixed"


def test_fsdp_reduces_in_float32():
    for precision, half in (("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)):
        mixed = fsdp_mixed_precision(precision)
        assert (mixed.param_dtype, mixed.reduce_dtype, mixed.buffer_dtype) == \
            (half, torch.float32, torch.float32)
    assert fsdp_mixed_precision("32-true") is None


def test_compile_auto_is_on_for_gpus_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not compile_enabled("auto", "auto") and not compile_enabled("auto", "cpu")
    assert compile_enabled("auto", "gpu") and compile_enabled(True, "cpu")
    assert not compile_enabled(False, "gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert compile_enabled("auto", "auto")
