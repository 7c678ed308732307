"""Reading tensors from a file a user hands us, never running code from it: ``torch.load`` with
``weights_only=True``, and one line naming the file for each way it can fail.
"""

from __future__ import annotations

from minigpt.errors import UserError, first_line


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be read: missing, not minigpt's, or from another format version."""


def load_tensors(path, map_location="cpu", *, mmap: bool = False):
    """``torch.load(path, weights_only=True)``: tensors and plain values, never code; a file
    holding Python objects, or damaged, truncated or foreign, is one ``CheckpointError`` line."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        # not torch's message: it suggests weights_only=False, unsafe for a file from elsewhere
        if "unsupported global" in str(e).lower():
            raise CheckpointError(
                f"{path} holds Python objects besides tensors and plain values (pickled code "
                "could run when loading it); minigpt refused to load it: use a file written by "
                "minigpt (train.py, save_pretrained) or a model.safetensors") from None
        raise CheckpointError(f"{path} is not a readable checkpoint (not a file torch.save "
                              "wrote); a damaged or foreign file reads like this") from None
    except Exception as e:  # zip and I/O errors of a truncated or foreign file come in many types
        raise CheckpointError(f"{path} is not a readable checkpoint ({first_line(e)}); a "
                              "truncated or half-copied file reads like this: copy it again") \
            from None
