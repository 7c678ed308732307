"""The one-line report (exit status 2) of a config key or value that does not fit its schema:
an unknown key (added with ``+`` or not) with the closest valid one, a value of the wrong type,
a missing group option, an override that does not parse. ``config_errors()`` wraps an entry
point's Hydra ``main()``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import sys
import typing
from typing import Any

from minigpt.errors import UserError, one_line_errors

# Names other trainers use (nanoGPT's, Hugging Face's) -> ours, for "did you mean".
ALIASES = {"learning_rate": "lr", "lr_min": "min_lr", "min_learning_rate": "min_lr",
           "warmup_iters": "warmup_steps", "lr_decay_iters": "decay_steps",
           "max_iters": "max_steps", "block_size": "context_length",
           "n_positions": "context_length", "n_ctx": "context_length",
           "eval_interval": "val_check_interval", "log_interval": "log_every_n_steps",
           "grad_norm_clip": "grad_clip",
           "gradient_accumulation_steps": "accumulate_grad_batches", "max_grad_norm": "grad_clip"}


class ConfigKeyError(UserError, KeyError):
    """A config key no schema has (a misspelling, or one added with ``+``)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def _fields(schema: type) -> dict[str, Any]:
    """``{field name: resolved type}`` of a dataclass schema."""
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def _dataclass_of(annotation) -> type | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if dataclasses.is_dataclass(candidate):
            return candidate
    return None


def schema_keys(schema: type) -> list[str]:
    """Every dotted key a schema accepts (``optim.lr``, ``trainer.fsdp.sharding_strategy``...)."""
    keys = []
    for name, annotation in _fields(schema).items():
        keys.append(name)
        inner = _dataclass_of(annotation)
        if inner is not None:
            keys += [f"{name}.{k}" for k in schema_keys(inner)]
    return keys


def closest_key(key: str, schema: type) -> str | None:
    """The valid key most like ``key`` (under the same parent first), or None if none is close."""
    keys = schema_keys(schema)
    parent, _, leaf = key.rpartition(".")
    siblings = [k for k in keys if k.rpartition(".")[0] == parent]
    alias = ALIASES.get(leaf)
    for pool in (siblings, keys):
        if alias and (k := next((k for k in pool if k.rpartition(".")[2] == alias), None)):
            return k
        leaves = {k.rpartition(".")[2]: k for k in pool}
        match = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.6)
        if match:
            return leaves[match[0]]
    return None


def unknown_keys(cfg: Any, schema: type, prefix: str = "") -> list[str]:
    """The dotted keys of ``cfg`` (a dict or ``DictConfig``) that ``schema`` does not have."""
    if not isinstance(cfg, dict):
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_container(cfg, resolve=False)
    fields, found = _fields(schema), []
    for key, value in cfg.items():
        if key not in fields:
            found.append(f"{prefix}{key}")
        elif isinstance(value, dict) and (inner := _dataclass_of(fields[key])) is not None:
            found += unknown_keys(value, inner, f"{prefix}{key}.")
    return found


def added_unknown_keys(overrides: list[str], schema: type) -> list[str]:
    """The dotted keys that command-line ``+key=value`` / ``++key=value`` overrides would add
    under one of ``schema``'s config groups without being in it (checked before Hydra composes,
    so nothing is written first); a key under a field typed ``Any`` may be anything, and keys
    outside the schema's groups (``hydra.*``, a group's own defaults) are Hydra's."""
    fields, found = _fields(schema), []
    for override in overrides:
        key = override.lstrip("+").partition("=")[0]
        if override.startswith("+") and "." in key and "@" not in key \
                and _dataclass_of(fields.get(key.partition(".")[0])) is not None:
            nested = None
            for part in reversed(key.split(".")):
                nested = {part: nested}
            found += [key] if unknown_keys(nested, schema) else []
    return found


def check_keys(cfg: Any, schema: type) -> None:
    """Raise ``ConfigKeyError`` (one line, each unknown key with the closest valid one) unless
    every key of the composed ``cfg`` is in ``schema``: the check Hydra skips for a key added
    with ``+``. Entry points call it first, inside ``one_line_errors``."""
    unknown = unknown_keys(cfg, schema)
    if unknown:
        raise ConfigKeyError("; ".join(_unknown_key(key, schema) for key in unknown))


def _unknown_key(key: str, schema: type) -> str:
    near = closest_key(key, schema)
    return f"unknown config key {key}: " + (f"did you mean {near}?" if near else
                                            "see configs/ for the valid keys")


def describe_config_error(error: BaseException, schema: type) -> str | None:
    """One line for an error Hydra or OmegaConf raised while composing a config against
    ``schema`` (an unknown key, a value of the wrong type, a missing group option, an override
    that does not parse), or None if ``error`` is something else."""
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, OmegaConfBaseException, ValidationError
    from omegaconf.errors import ConfigKeyError as OmegaConfKeyError

    chain, e = [], error
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    if not any(isinstance(e, (HydraException, OmegaConfBaseException)) for e in chain):
        return None
    for e in chain:
        full_key = getattr(e, "full_key", None)
        if isinstance(e, (OmegaConfKeyError, ConfigAttributeError)) and full_key:
            return _unknown_key(full_key, schema)
        if isinstance(e, ValidationError) and full_key:
            reason = _first_line(getattr(e, "msg", "") or str(e))
            value = getattr(e, "value", "?")
            unset = isinstance(value, str) and value.strip().lower() == "none"
            return f"{full_key}={value!r} does not fit its type: {reason}" + (
                f"; to leave it unset write {full_key}=null (None is a word to Hydra, not "
                "Python's None)" if unset else "")
        if isinstance(e, MissingConfigException):
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            options = [line for line in lines[2:] if not line.startswith(("Config search",
                                                                           "provider="))]
            listed = ", ".join(o for o in options if o != "schema")
            return f"{lines[0]}" + (f"; {lines[1].rstrip(':').lower()}: {listed}" if listed
                                    else "")
        if isinstance(e, OverrideParseException):
            return f"cannot read the override {e.override!r}: {_first_line(e.message)} (see " \
                   "https://hydra.cc/docs/advanced/override_grammar/basic)"
    lines = [line.strip() for line in str(chain[0]).splitlines() if line.strip()]
    return "bad config or override: " + "; ".join(
        line for line in lines if not line.startswith("See https"))


def _first_line(text: str) -> str:
    return (str(text).strip().splitlines() or [""])[0]


@contextlib.contextmanager
def config_errors(schema: type):
    """Around an entry point's Hydra ``main()``: what Hydra or OmegaConf raises for a bad key or
    value becomes ``error: <one line>`` on stderr and exit status 2; so does a key added with
    ``+`` on the command line that the schema lacks, before Hydra composes (or makes a run
    directory). Hydra raises (rather than prints) only with ``HYDRA_FULL_ERROR=1``, which this
    sets for the process."""
    with one_line_errors():
        unknown = added_unknown_keys(sys.argv[1:], schema)
        if unknown:
            raise ConfigKeyError("; ".join(_unknown_key(key, schema) for key in unknown))
        os.environ["HYDRA_FULL_ERROR"] = "1"
        try:
            yield
        except Exception as e:
            message = describe_config_error(e, schema)
            if message is None:
                raise
            raise UserError(message) from None
