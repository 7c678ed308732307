"""The CPU speedups' tests: ``avx2_only`` runs a test as on a CPU without oneDNN's bfloat16 path
(``avx2_only.py`` does it for a whole test run)."""

import pytest

from minigpt.cpu import onednn


@pytest.fixture
def avx2_only(monkeypatch):
    """The capability probes answer as on an AVX2-only CPU (AMD Zen 1-3, many Intel desktop and
    laptop chips): oneDNN cannot pack or multiply bfloat16 there."""
    monkeypatch.setattr(onednn, "packs_bfloat16", lambda: False)
    monkeypatch.setattr(onednn, "cpu_capability", lambda: "AVX2")
