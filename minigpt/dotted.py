"""What a dotted path in a config names (``torch.optim.SGD``, ``mypackage.tasks.MyTask``): each
extension point (optimizers, data sources, evaluation tasks) is one ``ExtensionPoint`` that
imports and checks what a path names and runs its first use; each failure is one
``ExtensionError`` line naming the config key, the path, what was wrong and where.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from minigpt.errors import ConfigError, UserError, first_line


class ExtensionError(ConfigError):
    """A dotted path of a config that does not name what its key wants, or whose code failed
    at its first use; one line naming the key and the fix."""


@dataclass(frozen=True)
class ExtensionPoint:
    """A config key that takes a dotted path: ``kind`` words what it must name (``"a
    torch.optim.Optimizer subclass"``), ``misfit(object)`` says what is wrong with an object
    (None: nothing), ``fix`` is the advice that ends every error line."""

    key: str
    kind: str
    misfit: Callable[[object], str | None]
    fix: str

    def load(self, path: str, key: str | None = None) -> object:
        """What ``path`` names (Hydra's ``get_object``), checked; ``key``: the key that gave it,
        if not ``self.key``."""
        from hydra.utils import get_object

        try:
            found = get_object(path)
        except Exception as e:  # ImportError, AttributeError, ValueError: all say the path is wrong
            why = first_line(e, root_cause=True)
        else:
            why = self.misfit(found)
            if not why:
                return found
        raise ExtensionError(f"{key or self.key}={path!r} is not {self.kind} ({why}): {self.fix}")

    @contextlib.contextmanager
    def first_use(self, path: str, doing: str, fix: str | None = None) -> Iterator[None]:
        """Run user code inside: an exception it raises (not a ``UserError``, which is one
        line already) becomes one line naming the key, ``doing`` (``"when called with ..."``),
        the error, the file and line that raised it, and ``fix`` (default: fix the code there,
        or name another object)."""
        try:
            yield
        except UserError:
            raise
        except Exception as e:
            fix = fix or f"fix that code, or set {self.key} to {self.kind} that works"
            frames = traceback.extract_tb(e.__traceback__)  # the innermost one raised it
            where = f"raised at {frames[-1].filename}:{frames[-1].lineno}" if frames else "raised"
            raise ExtensionError(f"{self.key}={path} failed {doing}: {first_line(e)} ({where}): "
                                 f"{fix}") from None

    def returned(self, path: str, result: object, wanted: str, fits: bool) -> None:
        """One line unless ``fits``: ``result`` is not the ``wanted`` thing."""
        if not fits:
            raise ExtensionError(f"{self.key}={path} returned {kind_of(result)}, not "
                                 f"{wanted}: {self.fix}")


EXTENSION_POINTS: dict[str, ExtensionPoint] = {}


def extension_point(key: str, kind: str, misfit: Callable[[object], str | None],
                    fix: str) -> ExtensionPoint:
    """The ``ExtensionPoint`` of ``key``, listed in ``EXTENSION_POINTS`` (a test walks them)."""
    point = EXTENSION_POINTS[key] = ExtensionPoint(key, kind, misfit, fix)
    return point


def kind_of(value: object) -> str:
    """``"an int"``, ``"a list"``, ``"None"``: what a value is, in a message."""
    if value is None:
        return "None"
    name = type(value).__name__
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"
