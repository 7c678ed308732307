"""The YAML files state only what differs: no key of a config group's file holds the value it
would have without it (the schema's default, or what the file it starts from gives it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from minigpt.config.schema import GROUP_SCHEMAS, ModelSchema

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SCHEMAS = {**dict(GROUP_SCHEMAS), "attention": ModelSchema}  # attention/: @package model
GLOBAL = "# @package _global_"


def _defaults(schema: type) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(schema), resolve=False)


def own_values(group: str, path: Path) -> dict:
    """What ``path`` itself sets in its group (a ``_global_`` file: under the group's key)."""
    text = path.read_text()
    content = yaml.safe_load(text) or {}
    content.pop("defaults", None)
    return content.get(group, {}) if GLOBAL in text else content


def inherited(group: str, path: Path) -> dict:
    """The group's values before ``path``'s own: its schema's defaults, then every file of the
    group that its ``defaults:`` list starts from."""
    values = _defaults(SCHEMAS[group])
    for entry in (yaml.safe_load(path.read_text()) or {}).get("defaults", []):
        if isinstance(entry, str) and entry not in ("schema", "_self_") \
                and not entry.startswith("/"):
            parent = CONFIGS / group / f"{entry}.yaml"
            values = _merged(_merged(values, inherited(group, parent)),
                             own_values(group, parent))
    return values


def _merged(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def restated(own: dict, before: dict, prefix: str = "") -> list[str]:
    """The dotted keys of ``own`` whose values equal ``before``'s."""
    found = []
    for key, value in own.items():
        if isinstance(value, dict) and isinstance(before.get(key), dict):
            found += restated(value, before[key], f"{prefix}{key}.")
        elif key in before and before[key] == value:
            found.append(f"{prefix}{key}={value!r}")
    return found


FILES = [(group, path) for group in SCHEMAS for path in sorted((CONFIGS / group).glob("*.yaml"))]


@pytest.mark.parametrize(("group", "path"), FILES, ids=[f"{g}/{p.stem}" for g, p in FILES])
def test_group_files_state_only_what_differs(group, path):
    assert restated(own_values(group, path), inherited(group, path)) == []


def test_the_check_finds_a_restated_default(tmp_path):
    toy = (CONFIGS / "model" / "toy.yaml").read_text()
    assert restated(yaml.safe_load(toy + "\nbias: true\n"), _defaults(ModelSchema)) == \
        ["bias=True"]
    assert restated({"fsdp": {"state_dict_type": "sharded"}}, _defaults(SCHEMAS["trainer"])) \
        == ["fsdp.state_dict_type='sharded'"]
