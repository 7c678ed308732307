"""Checkpoints: ``format`` (keys, file names, versions), ``read`` (exported here: torch and the
core only), ``write`` and ``restore`` (a training run's, on Fabric), ``consolidate``."""

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
from minigpt.files import CheckpointError, load_tensors

__all__ = ["FORMAT_VERSION", "METADATA_KEY", "MODEL_FILE", "CheckpointError", "checkpoint_metadata",
           "find_latest_checkpoint", "is_sharded_checkpoint", "load_checkpoint", "load_model",
           "load_tensors", "model_file_for", "read_checkpoint"]
