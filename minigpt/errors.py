"""Turning exceptions from deep inside libraries into one readable line."""

from __future__ import annotations


def first_line(error: BaseException, limit: int = 200, *, root_cause: bool = False) -> str:
    """``"TypeName: first line of the message"``, cut to ``limit`` characters; with
    ``root_cause`` the innermost chained exception's (it usually says the most)."""
    if root_cause:
        while error.__cause__ is not None or error.__context__ is not None:
            error = error.__cause__ or error.__context__
    line = (str(error).strip().splitlines() or [""])[0]
    if len(line) > limit:
        line = line[: limit - 3] + "..."
    return f"{type(error).__name__}: {line}" if line else type(error).__name__
