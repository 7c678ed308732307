"""Ctrl-C while the main thread is inside one long native call (a step made long on purpose):
the first asks for a checkpoint after the step and says so at once, the second ends the process
within a couple of seconds, not when the call returns."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# One native call of minutes on one thread: 4096 x 4096 float32 matrix products (137 GFLOP
# each), about 40 of them inside one torch.linalg.matrix_power.
LONG_STEP = """
import time
import torch
from minigpt.train.interrupt import StopRequest

torch.set_num_threads(1)
a = torch.full((4096, 4096), 1 / 4096)
stop = StopRequest()
with stop.installed():
    print("ready", flush=True)
    start = time.perf_counter()
    torch.linalg.matrix_power(a, 2**20 - 1)
    print(f"the step returned after {time.perf_counter() - start:.0f} s", flush=True)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_second_ctrl_c_ends_a_long_native_step_at_once():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-c", LONG_STEP], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # inside matrix_power now
        process.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert process.poll() is None  # the first Ctrl-C lets the step finish ...
        sent = time.perf_counter()
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=30)  # ... the second does not wait for it
        waited = time.perf_counter() - sent
    finally:
        process.kill()
        process.wait()
    out, err = process.stdout.read(), process.stderr.read()
    assert "returned" not in out  # the step never finished
    assert waited < 3, waited
    assert code in (130, -signal.SIGINT), (code, err)
    assert "Ctrl-C: saving a checkpoint after this step (Ctrl-C again to abort)" in err
