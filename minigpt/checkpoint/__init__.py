"""Checkpoints, in one package: what one holds, reading it back, writing it, resuming from it.

- ``format``: the keys, file names and format versions (read this first);
- ``safe_load``: reading tensors from a file a user hands us, never running code from it;
- ``read``: a checkpoint checked and rebuilt into a model and tokenizer (``load_checkpoint``),
  or whichever model a command names (``load_model``);
- ``write``: the training state, written whole under a temporary name and renamed into place,
  ``last`` linked to ``best`` (Lightning Fabric);
- ``restore``: is a checkpoint this run's to continue, and loading it back into the run (Fabric);
- ``consolidate``: a sharded FSDP checkpoint -> one model file,
  ``python -m minigpt.checkpoint consolidate RUN_DIR``.

The reading side, exported here, belongs to the core: importing it loads torch and minigpt's
core only. ``write`` and ``restore`` are the training run's and import Fabric: import them by
their module names.
"""

from minigpt.checkpoint.format import (
    FORMAT_VERSION,
    METADATA_KEY,
    MODEL_FILE,
    checkpoint_metadata,
    is_sharded_checkpoint,
)
from minigpt.checkpoint.read import (
    find_latest_checkpoint,
    load_checkpoint,
    load_model,
    model_file_for,
    read_checkpoint,
)
from minigpt.checkpoint.safe_load import CheckpointError, load_tensors

__all__ = ["FORMAT_VERSION", "METADATA_KEY", "MODEL_FILE", "CheckpointError", "checkpoint_metadata",
           "find_latest_checkpoint", "is_sharded_checkpoint", "load_checkpoint", "load_model",
           "load_tensors", "model_file_for", "read_checkpoint"]
