"""Single-field checks of a settings dataclass: each field's type (its annotation) and its rule
(a range or a set of choices, from one table), in the command line's spelling (``null``,
``true``); shared by the core's ``GPTConfig`` and the application's config schemas.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Range:
    """``low <= value <= high`` (either end open, either one absent); never nan or infinite."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself is out
    high_open: bool = False  # high itself is out

    def holds(self, value) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value < self.low or self.low_open and value == self.low):
            return False
        return self.high is None or value < self.high or not self.high_open and value == self.high

    def phrase(self, kind: str) -> str:
        """What a value must be, e.g. ``a positive integer``, ``a number in [0, 1)``."""
        if self.high is None and self.low == 0 and self.low_open:
            return f"a positive {kind.split()[-1]}"
        if self.high is None and self.low == 1 and not self.low_open and kind == "an integer":
            return "a positive integer"
        if self.high is None:
            return f"{kind} {'>' if self.low_open else '>='} {_number(self.low)}"
        if self.low is None:
            return f"{kind} {'<' if self.high_open else '<='} {_number(self.high)}"
        return (f"{kind} in {'(' if self.low_open else '['}{_number(self.low)}, "
                f"{_number(self.high)}{')' if self.high_open else ']'}")


@dataclass(frozen=True)
class OneOf:
    """One of a few named choices."""

    choices: tuple

    def holds(self, value) -> bool:
        return value in self.choices

    def phrase(self, kind: str) -> str:
        return "one of " + ", ".join(spell(c) if not isinstance(c, str) else c
                                     for c in self.choices)


@dataclass(frozen=True)
class Satisfies:
    """A rule of its own (e.g. a count or a fraction), with the words that say it."""

    test: Callable[[Any], bool]
    words: str

    def holds(self, value) -> bool:
        return self.test(value)

    def phrase(self, kind: str) -> str:
        return self.words


Rule = Range | OneOf | Satisfies


def spell(value) -> str:
    """``value`` as a command line writes it: ``null``, ``true``/``false``, strings quoted."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _kind(annotation) -> tuple[str | None, bool]:
    """(``an integer`` | ``a number`` | ``true or false`` | ``a string`` | None for anything,
    whether null is allowed) of a field's resolved annotation."""
    optional = False
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        annotation = args[0] if len(args) == 1 else Any
    return {int: "an integer", float: "a number", bool: "true or false",
            str: "a string"}.get(annotation), optional


def _fits(value, kind: str | None) -> bool:
    if kind is None:
        return True
    if kind == "true or false":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    return isinstance(value, {"an integer": int, "a number": (int, float), "a string": str}[kind])


def field_problems(settings, rules: dict[str, Rule], prefix: str = "", _key: str = "") -> list[str]:
    """Every field of the dataclass ``settings`` (nested ones included) whose value does not fit
    its type or its rule in ``rules`` (keyed by dotted field name), one phrase each:
    ``<prefix><key>=<value> must be <what>``."""
    hints = typing.get_type_hints(type(settings))
    problems = []
    for f in dataclasses.fields(settings):
        value, key = getattr(settings, f.name), f"{_key}{f.name}"
        if dataclasses.is_dataclass(value):
            problems += field_problems(value, rules, prefix, f"{key}.")
            continue
        kind, optional = _kind(hints[f.name])
        rule = rules.get(key)
        if value is None and optional:
            continue
        if _fits(value, kind) and (rule is None or rule.holds(value)):
            continue
        what = rule.phrase(kind or "a value") if rule is not None else kind
        if what is None:
            continue  # a field typed Any with no rule: anything goes
        problems.append(f"{prefix}{key}={spell(value)} must be {what}"
                        + (" or null" if optional else ""))
    return problems
