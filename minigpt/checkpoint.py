"""The one place that reads a training checkpoint back into a model and its tokenizer.

A checkpoint is Lightning's ``.ckpt`` (a plain dict saved with ``torch.save``). Besides Lightning's
own keys it carries ``checkpoint["minigpt"]`` = ``checkpoint_metadata(...)``: the model config and
the tokenizer as plain types, so ``torch.load(weights_only=True)`` can read it and nothing else
(no YAML, no data directory) is needed to rebuild the model. Model weights are stored under
``state_dict`` with the prefix ``model.`` (the LightningModule's attribute), never ``_orig_mod.``.
"""

from __future__ import annotations

FORMAT_VERSION = 1
METADATA_KEY = "minigpt"
MODEL_PREFIX = "model."


def checkpoint_metadata(model_config: dict, tokenizer: dict) -> dict:
    """What ``generate.py`` needs to rebuild the model: plain dicts only (weights_only-safe)."""
    from minigpt import __version__

    return {
        "format_version": FORMAT_VERSION,
        "minigpt_version": __version__,
        "model_config": dict(model_config),
        "tokenizer": dict(tokenizer),
    }
