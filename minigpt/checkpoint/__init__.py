"""Checkpoints: ``format`` (keys, file names, versions: read it first), ``safe_load`` (tensors,
never code), ``read`` (``load_checkpoint``, ``load_model``), ``write`` and ``restore`` (the
training run's, on Fabric: import them by module), ``consolidate`` (sharded FSDP -> one file,
``python -m minigpt.checkpoint consolidate RUN_DIR``). The reading side, exported here, needs
only torch and minigpt's core.
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
