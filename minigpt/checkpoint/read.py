"""Reading a checkpoint back (torch and minigpt's core only): checked to be minigpt's, then
rebuilt into a model and tokenizer."""

from __future__ import annotations

from pathlib import Path

from minigpt.checkpoint.format import (
    METADATA_FILE,
    METADATA_KEY,
    MODEL_FILE,
    MODEL_PREFIX,
    READABLE_VERSIONS,
    WEIGHTS_KEYS,
    is_sharded_checkpoint,
    model_weights,
)
from minigpt.errors import first_line
from minigpt.files import CheckpointError, load_tensors


def read_checkpoint(path, map_location="cpu", *, sharded: bool = False) -> dict:
    """A training checkpoint's dict (read weights-only), checked to be one minigpt can rebuild
    a model from: ``FileNotFoundError`` for a missing file, else one ``CheckpointError`` line for
    an unreadable file, not minigpt's, or of a ``format_version`` it does not read.
    ``sharded=True`` (resuming) also takes a sharded FSDP directory: its non-tensor part."""
    import zipfile

    path = Path(path)
    shards = is_sharded_checkpoint(path)
    if shards and not sharded:
        raise CheckpointError(f"{path} is a sharded FSDP checkpoint (a directory); read its model "
                              f"from {path.parent / MODEL_FILE}, written at the end of the run "
                              f"or by `python -m minigpt.checkpoint consolidate {path}`")
    if shards:
        path = path / METADATA_FILE  # the weights are checked when FSDP loads its shards
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}" + (" (a directory; name the .ckpt file)"
                                                              if path.is_dir() else ""))
    # Memory-mapped where the format allows (torch.save's zip files): checking costs little.
    checkpoint = load_tensors(path, map_location=map_location, mmap=zipfile.is_zipfile(path))
    meta = checkpoint.get(METADATA_KEY) if isinstance(checkpoint, dict) else None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} is not a minigpt checkpoint (no {METADATA_KEY!r} metadata; "
                              "was it written by minigpt's train.py?)")
    version = meta.get("format_version")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{path} has checkpoint format_version={version!r} (minigpt "
            f"{meta.get('minigpt_version', '?')}); this minigpt reads format_version "
            f"{' or '.join(map(str, READABLE_VERSIONS))}: upgrade minigpt to read it"
        )
    for key in ("model_config", "tokenizer"):
        if not isinstance(meta.get(key), dict):
            raise CheckpointError(f"{path} has minigpt metadata without its {key!r}")
    if shards:
        return checkpoint
    state = model_weights(checkpoint)
    if not isinstance(state, dict) or not any(k.startswith(MODEL_PREFIX) for k in state):
        raise CheckpointError(f"{path} has no model weights (no keys starting with "
                              f"{MODEL_PREFIX!r} under {' or '.join(map(repr, WEIGHTS_KEYS))})")
    return checkpoint


def load_checkpoint(path, map_location="cpu", **config_overrides):
    """``(GPT, Tokenizer, metadata)`` of a training checkpoint, in eval mode.
    ``config_overrides`` may set ``dropout`` and ``context_length`` (at most a learned position
    table's length, which is cropped to it; any without one)."""
    from minigpt.model import GPT, GPTConfig
    from minigpt.tokenizer import tokenizer_from_dict

    checkpoint = read_checkpoint(path, map_location)
    meta, state = checkpoint[METADATA_KEY], model_weights(checkpoint)
    weights = {k[len(MODEL_PREFIX):]: v for k, v in state.items() if k.startswith(MODEL_PREFIX)}
    fields = _with_overrides(path, meta["model_config"], config_overrides)
    try:
        config = GPTConfig.from_dict(fields)
    except ValueError as e:
        raise CheckpointError(f"{path} records a model config this minigpt cannot build: "
                              f"{e}") from None
    if "pos_emb.weight" in weights:  # maybe cropped to a shorter context
        weights["pos_emb.weight"] = weights["pos_emb.weight"][:config.context_length]
    model = GPT(config)
    try:
        model.load_state_dict(weights)
        tokenizer = tokenizer_from_dict(meta["tokenizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: its weights or tokenizer do not match its recorded "
                              f"config ({first_line(e)})") from None
    return model.eval(), tokenizer, meta


def _with_overrides(path, recorded: dict, overrides: dict) -> dict:
    """The recorded model config with ``dropout`` / ``context_length`` overridden, checked."""
    unknown = sorted(set(overrides) - {"dropout", "context_length"})
    if unknown:
        raise ValueError(f"load_checkpoint: only dropout and context_length can be changed, "
                         f"not {unknown}")
    context = overrides.get("context_length")
    saved = recorded.get("context_length")
    if context is not None and recorded.get("position", "learned") == "learned" \
            and isinstance(saved, int) and context > saved:
        raise CheckpointError(f"context_length={context} exceeds the checkpoint's context_length="
                              f"{saved} ({path}): its position table stops there; ask for "
                              f"context_length <= {saved}")
    return {**recorded, **{k: v for k, v in overrides.items() if v is not None}}


def model_file_for(path) -> Path:
    """``path``, or for a sharded checkpoint the ``model.ckpt`` beside it when that was written
    from it or later (else ``path``, whose reader then says how to consolidate)."""
    path = Path(path)
    model_file = path.parent / MODEL_FILE
    if is_sharded_checkpoint(path) and model_file.is_file() and \
            model_file.stat().st_mtime >= (path / METADATA_FILE).stat().st_mtime:
        return model_file
    return path


def find_latest_checkpoint(root="outputs") -> Path:
    """The most recently modified ``last.ckpt`` anywhere under ``root``."""
    root = Path(root)
    candidates = sorted(root.rglob("last.ckpt"), key=lambda p: p.stat().st_mtime) \
        if root.is_dir() else []
    if not candidates:
        raise FileNotFoundError(
            f"no checkpoint found: looked for last.ckpt under {root.resolve()}"
            + ("" if root.is_dir() else " (which does not exist)")
            + "; train one with `python train.py` or pass ckpt_path=... or pretrained=..."
        )
    return candidates[-1]


def load_model(ckpt_path=None, pretrained=None, checkpoints_root="outputs"):
    """``(model, tokenizer, source)`` in eval mode: a Hugging Face GPT-2 directory
    (``pretrained``), a training checkpoint (``ckpt_path``; ``model_file_for`` it), or else the
    newest ``last.ckpt`` under ``checkpoints_root``."""
    if ckpt_path is not None and pretrained is not None:
        raise ValueError("give ckpt_path or pretrained, not both")
    if pretrained is not None:
        from minigpt.model import GPT
        from minigpt.tokenizer import get_tokenizer

        return GPT.from_pretrained(str(pretrained)).eval(), get_tokenizer("gpt2"), str(pretrained)
    path = ckpt_path if ckpt_path is not None else find_latest_checkpoint(checkpoints_root)
    path = model_file_for(path)  # a sharded FSDP checkpoint: the model file consolidated from it
    model, tokenizer, _ = load_checkpoint(path)
    return model, tokenizer, str(path)
