"""Data: sources -> tokens (``prepare_dataset``) -> memory-mapped batches (``TokenDataModule``).

``python -m minigpt.data data=<name>`` prepares one ``configs/data/<name>.yaml`` on its own.
Importing this package does no work; ``TokenDataModule`` (and with it torch) loads on first use.
"""

from minigpt.data.config import DataConfig, DataError
from minigpt.data.prepare import prepare_dataset
from minigpt.data.tokens import (
    check_token_ids,
    check_vocab_fits,
    dtype_for,
    load_meta,
    open_tokens,
)

__all__ = ["DataConfig", "DataError", "TokenDataModule", "check_token_ids", "check_vocab_fits",
           "dtype_for", "load_meta", "open_tokens", "prepare_dataset"]


def __getattr__(name: str):
    if name == "TokenDataModule":  # keeps torch out of `python -m minigpt.data`
        from minigpt.data.datamodule import TokenDataModule

        return TokenDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
