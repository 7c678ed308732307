"""What a dotted path in a config names (``torch.optim.SGD``, ``mypackage.tasks.MyTask``): how
the extension points (optimizers, data sources, evaluation tasks) find a user's code."""

from __future__ import annotations

from collections.abc import Callable

from minigpt.errors import first_line


def named_object(path: str, fits: Callable[[object], bool], misfit: str) -> tuple[object, str]:
    """``(object, "")`` for what ``path`` names (Hydra's ``get_object``) if ``fits(object)``,
    else ``(None, why)``: the import's error in one phrase, or ``misfit``. The caller words the
    one-line error, naming its config key."""
    from hydra.utils import get_object

    try:
        found = get_object(path)
    except Exception as e:  # ImportError, AttributeError, ValueError: all say the path is wrong
        return None, first_line(e, root_cause=True)
    return (found, "") if fits(found) else (None, misfit)
