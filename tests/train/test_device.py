"""minigpt.train.device: precision per device (minigpt.devices' rule), compile on GPUs."""

import pytest
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


@pytest.mark.parametrize("name, flops", [("NVIDIA H200", 989.4e12), ("NVIDIA H200 NVL", 835.5e12),
                                         ("NVIDIA H100 80GB HBM3", 989.4e12)])
def test_peak_flops_is_the_dense_bf16_figure(monkeypatch, name, flops):
    """Lightning's table misses "NVIDIA H200" (and lists H200s with 2:4 sparsity, twice the
    dense figure its H100 entry gives): MFU on an H200 was n/a."""
    from minigpt.train.device import peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda", 0), torch.bfloat16) == pytest.approx(flops)


def test_peak_flops_unknown_device_is_none():
    from minigpt.train.device import peak_flops

    assert peak_flops(torch.device("cpu"), torch.bfloat16) is None
