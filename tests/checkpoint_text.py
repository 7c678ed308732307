"""A checkpoint's contents as JSON text, so test fixtures are reviewable text in git, not binary.

``to_text`` turns what ``torch.load(..., weights_only=True)`` returns (dicts with any keys, lists,
tuples, tensors, plain scalars) into JSON; ``from_text`` rebuilds the same objects, bit for bit
(a float32 value is written as its shortest decimal that rounds back to it), for ``torch.save``.

    python tests/checkpoint_text.py CHECKPOINT > FIXTURE.json     # how a fixture is made
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch


def _encode(value):
    if isinstance(value, dict):
        return {"dict": [[_encode(k), _encode(v)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, torch.Tensor):
        data = value.flatten().tolist()
        if value.dtype == torch.float32:  # shortest decimals of the float32 values
            data = [float(str(np.float32(x))) for x in data]
        return {"tensor": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
                "data": data}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot write {type(value).__name__} as checkpoint text")


def _decode(value):
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "dict" in value:
        return {_decode(k): _decode(v) for k, v in value["dict"]}
    if "tuple" in value:
        return tuple(_decode(v) for v in value["tuple"])
    dtype = getattr(torch, value["tensor"])
    return torch.tensor(value["data"], dtype=dtype).reshape(value["shape"])


def to_text(checkpoint: dict) -> str:
    return json.dumps(_encode(checkpoint), separators=(",", ":"))


def from_text(text: str) -> dict:
    return _decode(json.loads(text))


if __name__ == "__main__":
    print(to_text(torch.load(sys.argv[1], weights_only=True)))
