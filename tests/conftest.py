"""Fixtures and settings shared by several test files."""

import os
from pathlib import Path

import pytest
import torch
from checkpoint_text import from_text

from minigpt.config import register_schemas

# configs/**/*.yaml name their schemas: tests that compose them (Hydra's compose API) need them.
register_schemas()

# Tests never need an account or a network: wandb writes local files, the hubs are not asked.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# tiktoken's GPT-2 files cannot be downloaded on an offline machine; a checkout next to a
# `shared/tiktoken-cache` folder (as on the project's build machines) finds them there.
_SHARED_CACHE = Path(__file__).resolve().parents[1].parent / "shared" / "tiktoken-cache"
if "TIKTOKEN_CACHE_DIR" not in os.environ and _SHARED_CACHE.is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(_SHARED_CACHE)


@pytest.fixture
def one_thread():
    """Tiny models: one thread is faster than two, which mostly wait for each other on a busy
    machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def checkpoint_v1(tmp_path_factory) -> Path:
    """A checkpoint written by the code before the layout split (tests/fixtures/README.md), made
    a file again from its text form."""
    fixture = Path(__file__).parent / "fixtures" / "checkpoint_v1.json"
    path = tmp_path_factory.mktemp("fixtures") / "checkpoint_v1.ckpt"
    torch.save(from_text(fixture.read_text()), path)
    return path
