"""What a minigpt checkpoint holds: its keys, file names and format versions, in one place.

A checkpoint is a dict saved with ``torch.save`` (through Lightning Fabric while training) of
tensors and plain types only, so ``torch.load(weights_only=True)`` reads it:

- ``minigpt``: ``checkpoint_metadata(...)``, the model config and the tokenizer, enough to
  rebuild the model without the YAML or the data directory (and a chat model's template;
  checkpoints of earlier versions may hold other keys here, e.g. ``cpu_kernels``: ignored);
- the model's weights, prefixed ``model.`` (the training module's attribute, never
  ``_orig_mod.``): under ``model`` in ``format_version`` 2, under ``state_dict`` in version 1
  (written by Lightning's Trainer; still read and resumed);
- for resuming: the optimizers by name (``optimizer`` for AdamW, else the class's lower-case
  name: ``minigpt.train.optim.checkpoint_name``), their ``schedulers`` by the same names,
  ``data`` (the position in the batches), the loop's progress (``PROGRESS_KEYS``: the step, the
  losses, and the counters that decide what runs at a step; checkpoints before them hold the
  first three) and ``rng_states`` (one per process). Version 1 keeps them under
  ``LEGACY_KEYS``' names.

A sharded FSDP checkpoint is a directory: ``torch.distributed.checkpoint`` files with each
rank's shard of the weights and optimizer state, plus ``meta.pt`` with everything else.
"""

from __future__ import annotations

from pathlib import Path

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
METADATA_KEY = "minigpt"
MODEL_PREFIX = "model."
WEIGHTS_KEYS = ("model", "state_dict")  # where the weights sit: version 2, version 1
# minigpt.train.loop.Progress, at the top level
PROGRESS_KEYS = ("global_step", "best_val_loss", "val_loss", "validations", "train_seconds",
                 "target", "eval_metrics", "batch")
# Version 1 (Lightning's Trainer): where its parts sit, by the name version 2 gives them.
LEGACY_KEYS = {"model": "state_dict", "optimizer": "optimizer_states",
               "sharded_optimizer": "optimizer_0", "schedulers": "lr_schedulers",
               "data": "TokenDataModule"}

BEST, LAST = "best.ckpt", "last.ckpt"  # lowest val/loss, newest: in a run's checkpoints/
METADATA_FILE = "meta.pt"  # the non-tensor part of a sharded checkpoint directory
MODEL_FILE = "model.ckpt"  # the consolidated file, next to a sharded last.ckpt


def checkpoint_metadata(model_config: dict, tokenizer: dict,
                        chat_template: dict | None = None) -> dict:
    """What ``generate.py`` needs to rebuild the model: plain dicts only (weights_only-safe).
    A fine-tuned chat model adds its template (``minigpt.chat.template``, key ``chat_template``)."""
    from minigpt import __version__

    return {
        "format_version": FORMAT_VERSION,
        "minigpt_version": __version__,
        "model_config": dict(model_config),
        "tokenizer": dict(tokenizer),
        **({"chat_template": dict(chat_template)} if chat_template is not None else {}),
    }


def model_weights(checkpoint: dict) -> dict | None:
    """The prefixed weights of a checkpoint of either format version."""
    return next((checkpoint[k] for k in WEIGHTS_KEYS if isinstance(checkpoint.get(k), dict)), None)


def is_sharded_checkpoint(path) -> bool:
    """``path`` is a sharded FSDP checkpoint directory (it holds ``meta.pt``)."""
    path = Path(path)
    return path.is_dir() and (path / METADATA_FILE).is_file()
