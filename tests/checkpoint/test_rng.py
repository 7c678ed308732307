"""The RNG states in checkpoints (minigpt.checkpoint.write): this process's device only,
restorable on any layout."""

import random

import torch

from minigpt.checkpoint.write import rng_state, set_rng_state


def test_round_trip_restores_python_numpy_and_torch():
    state = rng_state()
    draws = (random.random(), torch.rand(3))
    set_rng_state(state)
    assert random.random() == draws[0] and torch.equal(torch.rand(3), draws[1])


def test_cuda_state_of_the_current_device_only(monkeypatch):
    """New checkpoints hold one CUDA state; old ones (one per visible GPU) restore the current
    device's, and a process that sees fewer GPUs than the writer skips it instead of failing."""
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: torch.tensor([7], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s: restored.append(int(s[0])))
    state = rng_state()
    assert int(state["cuda"][0]) == 7  # a tensor, not a list over every GPU
    set_rng_state(state)
    old = {**state, "cuda": [torch.tensor([1], dtype=torch.uint8),
                             torch.tensor([2], dtype=torch.uint8)]}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    set_rng_state(old)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # only 2 states were saved
    set_rng_state(old)
    assert restored == [7, 2]
