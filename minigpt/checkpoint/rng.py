"""Python, NumPy and torch RNG state in checkpoints, so a resumed run draws what the
uninterrupted one would have; each process saves its own device's generator only (a resumed run
may see other GPUs)."""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict:
    """The RNG states as weights_only-safe types (tensors, ints, tuples)."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (np_name, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss,
                  np_gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` returned (after a round trip through ``torch.load``)."""
    random.setstate(tuple(v if not isinstance(v, list) else tuple(v) for v in state["python"]))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state((np_name, np_keys.numpy().astype(np.uint32), np_pos, np_has_gauss,
                         np_gauss))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is None or not torch.cuda.is_available():
        return
    if isinstance(cuda, (list, tuple)):  # older checkpoints: one state per visible GPU, by index
        device = torch.cuda.current_device()
        if device >= len(cuda):
            return
        cuda = cuda[device]
    torch.cuda.set_rng_state(cuda)
