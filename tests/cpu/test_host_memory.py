"""minigpt.cpu.keep_freed_host_memory: with it, a training-like loop reuses its freed memory
without page faults."""

import subprocess
import sys

import pytest

# Steps shaped like a training step: large tensors made, used and freed, the same every step.
# After a few steps the heap holds the loop's peak, and later steps fault in no new pages.
PROGRAM = """
import resource, sys, torch
from minigpt.cpu import keep_freed_host_memory
if sys.argv[1] == "on":
    assert keep_freed_host_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():
    a = torch.ones(20_000_000); b = torch.ones(5_000_000); c = a[:5_000_000] + b
    del a, b, c
for _ in range(8):
    step()
before = faults()
for _ in range(3):
    step()
print(faults() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_repeated_large_allocations_stop_page_faulting():
    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True,
                             text=True, check=True)
        return int(out.stdout.split()[-1])

    # 3 steps touch ~120 MB each, ~29k pages of 4 KiB: glibc's default unmaps and maps them anew.
    assert faults("off") > 20_000
    assert faults("on") < 1_000


def test_not_linux_is_a_no_op(monkeypatch):
    import minigpt.cpu

    monkeypatch.setattr(minigpt.cpu.sys, "platform", "darwin")
    assert minigpt.cpu.keep_freed_host_memory() is False
