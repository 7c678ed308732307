"""minigpt.train.device: precision per device, GPU peaks for MFU."""

import torch

from minigpt.train import device
from minigpt.train.device import default_precision, peak_flops, resolve_accelerator


def test_mfu_peaks_only_for_known_gpus(monkeypatch):
    assert peak_flops(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA A100-SXM4-80GB")
    assert peak_flops(torch.device("cuda", 0)) == 312e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA H100 PCIe")
    assert peak_flops(torch.device("cuda", 0)) == 756e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "Some Future GPU")
    assert peak_flops(torch.device("cuda", 0)) is None


def test_default_precision(monkeypatch):
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: True)
    assert default_precision("cpu") == "bf16-mixed"
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
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
