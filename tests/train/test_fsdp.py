"""FSDP for real on two CPU processes (gloo).

Lightning refuses its FSDP strategy on CPUs, so this runs what that strategy runs with our
settings (tests/train/fsdp_worker.py: the module as root unit, one unit per Block, FULL_SHARD,
use_orig_params) under torchrun, and compares it with single-process training on whole batches:
sharding must not change the math. It also checks the sampling callback's parameter gathering.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not torch.distributed.is_available() or
                    not torch.distributed.is_gloo_available(), reason="needs torch.distributed")
def test_two_rank_fsdp_training_equals_single_process(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with socket.socket() as s:  # a free port on the loopback interface, as Lightning picks one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(port),
         str(ROOT / "tests" / "train" / "fsdp_worker.py"), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["moved"] > 1e-2  # training changed the weights ...
        assert rank["max_param_diff"] < 1e-4  # ... and sharded training changed them alike
        assert rank["sample"] == rank["reference_sample"]  # sampling sees the full weights
