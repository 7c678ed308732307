"""A file an attacker would hand us: ``torch.save`` of tensors plus an object whose unpickling
runs code (here ``os.mkdir(marker)``, which creates ``marker``). Loading it safely must refuse it
and leave ``marker`` absent."""

from __future__ import annotations

import os
from pathlib import Path

import torch


class RunsCode:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):  # unpickling calls os.mkdir(marker): it appears if the payload ran
        return os.mkdir, (self.marker,)


def save_with_payload(path: Path, marker: Path, tensors: dict | None = None) -> Path:
    """Write ``tensors`` (or one small tensor) and the payload to ``path``, as torch.save does."""
    torch.save({**(tensors or {"weight": torch.zeros(2)}), "payload": RunsCode(marker)}, path)
    assert not marker.exists()
    return path
