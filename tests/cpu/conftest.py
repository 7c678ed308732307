"""Kernel timings for the CPU speedups' tests: a fresh timings file per test, and fakes that
decide which kernel wins without timing anything."""

import pytest

import minigpt.cpu
import minigpt.cpu.tuning


@pytest.fixture(autouse=True)
def _fresh_kernel_timings(tmp_path, monkeypatch):
    """A timings file per test, taken on a quiet machine (the real load would decide whether
    a stored timing is measured again), retuning only where a test asks for it."""
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path / "minigpt-cache"))
    monkeypatch.delenv("MINIGPT_CPU_RETUNE", raising=False)
    monkeypatch.setattr(minigpt.cpu.tuning, "load_per_core", lambda: 0.0)


@pytest.fixture
def fake_timings(monkeypatch):
    """``fake_timings(train={matmul: {kernel: seconds}}, decode={kernel: seconds},
    prompt={product: seconds})``: what minigpt.cpu "measures" for every training key of that
    matmul / every decoding shape / every row-sum shape's prompt product."""
    calls = []

    def install(train=None, decode=None, prompt=None):
        if train is not None:
            def measure_matmuls(shapes):
                calls.append(sorted(shapes))
                return {key: dict(train[shape[3]]) for key, shape in shapes.items()}
            monkeypatch.setattr(minigpt.cpu, "measure_matmuls", measure_matmuls)
        if decode is not None:
            def measure_decoding(layers, keys):
                calls.append(sorted(keys))
                return {key: dict(decode) for key in keys}
            monkeypatch.setattr(minigpt.cpu, "measure_decoding", measure_decoding)
        if prompt is not None:
            def measure_prompt(layers, keys, weight_dtype):
                calls.append(sorted(keys))
                return {key: dict(prompt) for key in keys}
            monkeypatch.setattr(minigpt.cpu, "measure_prompt", measure_prompt)
        return calls

    return install
