"""A pytest plugin: the whole test run as on an AVX2-only CPU (no oneDNN bfloat16 path), so
that every speedup's step-aside branch is exercised on any CPU::

    python -m pytest -p tests.cpu.avx2_only tests/cpu tests/test_generate.py
"""

from minigpt.cpu import onednn


def pytest_configure(config):
    onednn.packs_bfloat16 = lambda: False
    onednn.cpu_capability = lambda: "AVX2"


def pytest_report_header(config):
    return "minigpt.cpu: as on an AVX2-only CPU (oneDNN's bfloat16 path reported missing)"
