"""User errors as one readable line: the error type entry points report without a traceback,
and the first line of exceptions raised deep inside libraries."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback


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


class UserError(Exception):
    """Bad input (a config value, data, a checkpoint, resources): its message is one line that
    names the value and the fix. Entry points print it and exit with status 2 (``one_line_errors``);
    any other exception is a bug and keeps its traceback."""


class ConfigError(UserError, ValueError):
    """A bad config value, found before any work starts; the message names each one."""


class ResourceError(UserError):
    """The machine cannot run what was asked (memory): the estimate, the limit and the knobs."""


USER_ERROR_EXIT_CODE = 2


@contextlib.contextmanager
def one_line_errors(*also: type[BaseException]):
    """A ``UserError``, ``FileNotFoundError`` or one of ``also`` -> ``error: <message>`` on
    stderr and exit status 2."""
    try:
        yield
    except (UserError, FileNotFoundError, *also) as e:
        message = " ".join(str(e).split())  # one line, whatever the message held
        print(f"error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(USER_ERROR_EXIT_CODE) from None


INTERRUPTED_EXIT_CODE = 130  # the shell's code for a process ended by Ctrl-C


@contextlib.contextmanager
def command_line_errors(*also: type[BaseException]):
    """``one_line_errors``, and Ctrl-C ends quietly with status 130."""
    try:
        with one_line_errors(*also):
            yield
    except KeyboardInterrupt:
        raise SystemExit(INTERRUPTED_EXIT_CODE) from None


@contextlib.contextmanager
def ending_distributed_failures_at_once():
    """Around an entry point: a process of a ``torch.distributed`` group that fails prints what
    it would, flushes its output and logs, and exits at once with its status. Interpreter shutdown
    would free the group while its worker threads still release finished work: a deadlock (they
    wait for the interpreter lock) or SIGABRT, losing the status. Success ends as usual."""
    try:
        yield
    except BaseException as ending:
        dist = sys.modules.get("torch.distributed")  # never imported here: only if it was
        if dist is None or not dist.is_available() or not dist.is_initialized():
            raise
        code = ending.code if isinstance(ending, SystemExit) else \
            INTERRUPTED_EXIT_CODE if isinstance(ending, KeyboardInterrupt) else 1
        if code in (0, None):
            raise
        if not isinstance(ending, SystemExit):
            traceback.print_exception(ending)
        elif not isinstance(code, int):  # SystemExit("message"): Python prints it, status 1
            print(code, file=sys.stderr)
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
