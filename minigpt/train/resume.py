"""Before resuming: is ``ckpt_path`` a checkpoint this run can continue? Told in one line.

Lightning would otherwise find out deep inside ``fit`` (a truncated file, a model that does not
fit the state dict, a step already past ``max_steps``) with a long traceback, or quietly do
nothing. The file is read with the same reader ``generate.py`` uses.
"""

from __future__ import annotations

from dataclasses import dataclass

from minigpt.checkpoint import METADATA_KEY, is_sharded_checkpoint, read_checkpoint
from minigpt.model import GPTConfig
from minigpt.train.checkpoints import OPTIMIZER_NAMES
from minigpt.train.config import ConfigError

# Fields a resumed run may change: they do not alter the weights' shapes or meaning.
CHANGEABLE_ON_RESUME = ("dropout",)


@dataclass
class ResumePoint:
    """What a checkpoint says about the run it continues, read once: the checks before the run
    and ``minigpt.train.checkpoints.restore`` both use it."""

    path: str
    step: int
    model_config: dict
    tokenizer: dict
    format_version: int
    optimizers: frozenset | None  # the optimizers' names in a whole file; None: not known


def read_resume_point(path: str, max_steps: int) -> ResumePoint:
    """Read ``path`` (readable, minigpt's, weights-only) and refuse to resume a run that is
    already at or past ``max_steps``."""
    checkpoint = read_checkpoint(path, sharded=True)
    step = int(checkpoint.get("global_step", 0))
    if step >= max_steps:
        raise ConfigError(f"ckpt_path={path} is at step {step}; trainer.max_steps={max_steps}: "
                          f"raise trainer.max_steps above {step} to continue")
    meta = checkpoint[METADATA_KEY]
    try:  # fields added since the checkpoint was written take their defaults, as when loading
        model_config = GPTConfig.from_dict(meta["model_config"]).to_dict()
    except ValueError as e:
        raise ConfigError(f"ckpt_path={path} records a model this minigpt cannot build: {e}") \
            from None
    version = int(meta["format_version"])
    optimizers = None if version < 2 or is_sharded_checkpoint(path) \
        else frozenset(k for k in OPTIMIZER_NAMES if k in checkpoint)
    return ResumePoint(str(path), step, model_config, dict(meta["tokenizer"]), version, optimizers)


def model_differences(resume: ResumePoint, model_config: dict, *, skip=()) -> list[str]:
    """``field=<run> here, <checkpoint> in the checkpoint`` for each field that differs."""
    skip = set(skip) | set(CHANGEABLE_ON_RESUME)
    fields = sorted((set(model_config) | set(resume.model_config)) - skip)
    return [f"model.{k}={model_config.get(k)!r} here, {resume.model_config.get(k)!r} in the "
            "checkpoint" for k in fields if model_config.get(k) != resume.model_config.get(k)]


def check_resume_matches(resume: ResumePoint, model_config: dict, tokenizer: dict | None = None,
                         *, skip=()) -> None:
    """One line naming every model field (and the tokenizer) that differs from the checkpoint,
    and the two ways forward."""
    problems = model_differences(resume, model_config, skip=skip)
    if tokenizer is not None and tokenizer != resume.tokenizer:
        problems.append(f"the data's tokenizer is {_describe(tokenizer)} here, "
                        f"{_describe(resume.tokenizer)} in the checkpoint")
    if problems:
        raise ConfigError(
            f"ckpt_path={resume.path} does not match this run: {'; '.join(problems)}. To resume, "
            "use the settings it was trained with (drop the overrides that changed them; its run "
            "directory's config.yaml lists them); to train a new model from its weights, start a "
            f"new run with model.init_from={resume.path}")


def _describe(tokenizer: dict) -> str:
    return f"{tokenizer.get('name')!r} ({tokenizer.get('vocab_size')} ids)"
