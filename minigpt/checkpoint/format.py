"""What a minigpt checkpoint holds: a ``torch.save`` dict of tensors and plain types only
(``torch.load(weights_only=True)`` reads it): ``minigpt`` (``checkpoint_metadata``: enough to
rebuild the model without the YAML; keys of earlier versions, e.g. ``cpu_kernels``, are
ignored), the weights prefixed ``model.`` (under ``model``; ``state_dict`` in version 1, written
by Lightning's Trainer and still read and resumed), and for resuming the optimizers by name,
their ``schedulers``, ``data``, ``PROGRESS_KEYS`` and ``rng_states`` (version 1: ``LEGACY_KEYS``).
A sharded FSDP checkpoint is a directory of ``torch.distributed.checkpoint`` files plus
``meta.pt`` with everything else.
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
