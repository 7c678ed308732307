"""Paths a user names, checked before any work: one line for each bad path, naming the config
key that gave it, the path, what is wrong and the fix. A schema marks each path-taking field
with ``path_field(kind)``; ``check_paths(settings)`` walks the fields (nested dataclasses too).
Reading and writing are tried, not asked (``os.access`` says yes to root); a FIFO or socket is
never opened (reading one may block).
"""

from __future__ import annotations

import dataclasses
import errno
import fnmatch
import os
import stat
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from minigpt.errors import UserError
from minigpt.files import new_file_beside

INPUT_FILE, INPUT_DIR, INPUT_FILE_OR_DIR = "input file", "input directory", "input file or dir"
INPUT_GLOBS = "input files or globs"
OUTPUT_FILE, OUTPUT_DIR = "output file", "output directory"
PATHS_INSIDE, NOT_A_PATH = "settings holding paths", "not a path"
KINDS = (INPUT_FILE, INPUT_DIR, INPUT_FILE_OR_DIR, INPUT_GLOBS, OUTPUT_FILE, OUTPUT_DIR,
         PATHS_INSIDE, NOT_A_PATH)
METADATA_KEY = "path"
# Files a minigpt command writes: a missing one says how to write it.
WRITTEN_BY = {"data/chat_synth": "write the synthetic set with python -m minigpt.chat.synthetic "
                                 "--out data/chat_synth"}


class PathError(UserError, OSError):
    """Bad paths in a config: one line, each naming its key, the path, the problem and the fix."""

    def __str__(self) -> str:  # OSError would format its arguments as a tuple
        return str(self.args[0])


class MissingPathError(PathError, FileNotFoundError):
    """A ``PathError`` where a path that should exist does not (or a glob matches nothing)."""


@dataclasses.dataclass(frozen=True)
class PathRole:
    """What a field's value is: ``kind`` (one of ``KINDS``); ``at_file``: only a value starting
    with ``@`` names a file (the rest after it), any other is text; ``words``: values that are
    not paths (``ckpt_path=last``); ``hub_name``: a value that is no local path may be a
    Hugging Face Hub name; ``when(owner, root)``: checked only when it holds (the field is read
    only then); ``inside``: for ``PATHS_INSIDE``, the dotted path of the dataclass the dict is;
    ``missing``: the fix for a path that does not exist."""

    kind: str
    at_file: bool = False
    words: tuple[str, ...] = ()
    hub_name: bool = False
    when: Callable[[Any, Any], bool] | None = None
    inside: str | None = None
    missing: str = ""


def path_field(kind: str, default: Any = None, *, default_factory: Any = dataclasses.MISSING,
               **role) -> Any:
    """A dataclass ``field`` marked as taking a path of ``kind`` (``PathRole``'s options)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {', '.join(KINDS)}")
    metadata = {METADATA_KEY: PathRole(kind, **role)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def no_model_given(settings: Any, _root: Any = None) -> bool:
    """``when`` of a ``checkpoints_root`` field: neither ``ckpt_path`` nor ``pretrained`` set."""
    return settings.ckpt_path is None and settings.pretrained is None


NO_MODEL = ("no model is named and there is no checkpoint to find there: give ckpt_path=FILE "
            "or pretrained=DIR, or train one first (python train.py)")  # checkpoints_root's fix


# ---------------------------------------------------------------------------- the schema walk

def path_problems(settings: Any, prefix: str = "", root: Any = None) -> list[str]:
    """One line for each bad path among the fields of the dataclass ``settings`` (keys written
    ``prefix`` + name), nested dataclasses included; fields whose ``when`` does not hold are
    not read and not checked."""
    root = settings if root is None else root
    problems = []
    for f in dataclasses.fields(settings):
        value, key = getattr(settings, f.name), prefix + f.name
        role = f.metadata.get(METADATA_KEY)
        if role is not None and role.when is not None and not role.when(settings, root):
            continue
        if dataclasses.is_dataclass(value):
            problems += path_problems(value, f"{key}.", root)
        elif role is not None and role.kind == PATHS_INSIDE:
            if isinstance(value, dict):
                inner = _inside_type(role)
                names = {g.name for g in dataclasses.fields(inner)}
                inner_value = inner(**{k: v for k, v in value.items() if k in names})
                problems += path_problems(inner_value, f"{key}.", root)
        elif role is not None and role.kind != NOT_A_PATH and value is not None:
            problems += value_problems(key, value, role)
    return problems


def check_paths(settings: Any) -> None:
    """Raise every bad path of ``settings`` (``path_problems``) as one ``PathError`` line (a
    ``MissingPathError`` when one is missing). Entry points call it before any work."""
    problems = path_problems(settings)
    if problems:
        raise path_error(problems)


def marked_paths(schema: type, prefix: str = "") -> list[tuple[str, PathRole | None,
                                                            dataclasses.Field]]:
    """``(key, role, field)`` of every field of ``schema`` and of the dataclasses under it
    (``PATHS_INSIDE`` ones too), ``role`` None where unmarked: what tests walk."""
    hints = typing.get_type_hints(schema)
    found = []
    for f in dataclasses.fields(schema):
        key, role = prefix + f.name, f.metadata.get(METADATA_KEY)
        inner = next((t for t in (hints[f.name], *typing.get_args(hints[f.name]))
                      if dataclasses.is_dataclass(t)), None)
        if inner is not None:
            found += marked_paths(inner, f"{key}.")
        elif role is not None and role.kind == PATHS_INSIDE:
            found += marked_paths(_inside_type(role), f"{key}.")
        else:
            found.append((key, role, f))
    return found


def _inside_type(role: PathRole) -> type:
    import importlib

    module, _, name = role.inside.rpartition(".")
    return getattr(importlib.import_module(module), name)


# --------------------------------------------------------------------------- one value, checked

class Missing(str):
    """A problem (phrase or line) that is a missing path: raised as ``MissingPathError``."""


def path_error(lines: list[str]) -> PathError:
    """The error of ``lines`` (one or more problems), as one line."""
    missing = any(isinstance(line, Missing) for line in lines)
    return (MissingPathError if missing else PathError)("; ".join(lines))


def _line(key: str, text: str, problem: str) -> str:
    line = f"{key}={text} {problem}"
    return Missing(line) if isinstance(problem, Missing) else line


def value_problems(key: str, value: Any, role: PathRole) -> list[str]:
    """The lines for one field's value (a path, a list of them, ``@file`` text) read as ``role``."""
    if isinstance(value, (list, tuple)):
        return [line for i, item in enumerate(value)
                for line in value_problems(f"{key}[{i}]", item, role)]
    text = os.fspath(value) if isinstance(value, os.PathLike) else str(value)
    if text in role.words or (role.at_file and not text.startswith("@")):
        return []
    path = os.path.expanduser(text[1:] if role.at_file else text)
    if role.hub_name and not os.path.lexists(path):
        from minigpt.hf import is_hub_name  # here, not at import: hf brings torch

        if is_hub_name(text):
            return []
    if role.kind == INPUT_GLOBS:
        return glob_problems(key, text, path)
    if role.kind in (OUTPUT_FILE, OUTPUT_DIR):
        problem = output_problem(path, role.kind)
    else:
        problem = input_problem(path, role.kind, role.missing)
    return [_line(key, text, problem)] if problem else []


def input_problem(path: str, kind: str = INPUT_FILE, missing: str = PathRole.missing
                  ) -> str | None:
    """What is wrong with ``path`` as an input of ``kind`` (a phrase and its fix), or None.
    A regular file is opened to prove it readable; nothing else is opened."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        return _unreachable(path, e, missing)
    if stat.S_ISDIR(mode):
        if kind == INPUT_FILE:
            return "is a directory, not a file: give a file in it"
        try:
            with os.scandir(path):
                pass
        except OSError as e:
            return f"is a directory this process cannot read ({e.strerror}): fix its permissions"
        return None
    if not stat.S_ISREG(mode):
        what = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else \
            "a device"
        wanted = "directory" if kind == INPUT_DIR else "regular file"
        return f"is {what}, not a {wanted} (never opened: reading {what} may never end): " \
               f"give a {wanted}"
    if kind == INPUT_DIR:
        return f"is a file, not a directory: give the directory that holds it " \
               f"({os.path.dirname(os.path.abspath(path))})"
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        return f"cannot be read ({e.strerror}): fix its permissions (chmod u+r) or copy it " \
               "somewhere readable"
    return None


def _unreachable(path: str, error: OSError, missing: str) -> str:
    if error.errno == errno.ELOOP:
        return "is a symbolic link loop (it points back to itself): point it at a real file " \
               "(ls -l shows where it points)"
    if error.errno == errno.ENOENT and os.path.islink(path):
        return f"is a broken symbolic link (to {os.readlink(path)}, which does not exist): " \
               "fix or remove the link"
    if error.errno in (errno.ENOENT, errno.ENOTDIR):
        written = next((fix for part, fix in WRITTEN_BY.items() if part in path), None)
        fix = written or missing or "check the spelling"
        return Missing(f"does not exist{_where(path)}; {fix}")
    return f"cannot be reached ({error.strerror}): fix the permissions of the directories above it"


def _where(path: str) -> str:
    """Where a missing path was looked for: the working directory of a relative one, else the
    last directory on its way that exists, when that is not its own directory."""
    if not os.path.isabs(path):
        return f" (cwd: {os.getcwd()})"
    absolute = Path(path)
    existing = next(p for p in absolute.parents if p.is_dir())
    if existing == absolute.parent:
        return ""
    return f" ({existing} has no {absolute.relative_to(existing).parts[0]})"


def output_problem(path: str, kind: str = OUTPUT_FILE) -> str | None:
    """What is wrong with ``path`` as an output of ``kind``, or None: a missing output directory
    is made, an output file's directory must exist; writing is proven by a temporary file."""
    absolute = Path(os.path.abspath(path))
    if kind == OUTPUT_DIR:
        if absolute.exists() and not absolute.is_dir():
            return "is a file, not a directory: give a directory (it is made if missing)"
        existing = next(p for p in (absolute, *absolute.parents) if os.path.lexists(p))
        if not existing.is_dir():
            return f"cannot be made: {existing} is a file, not a directory; give a directory " \
                   "that is not under a file"
        why = _cannot_create_in(existing)
        if why is None:
            return None
        if existing == absolute:
            return f"is read-only: {why}; give a directory you can write"
        return f"cannot be made: {why}; give a directory you can write"
    if absolute.is_dir():
        return f"is a directory, not a file: give a file name in it, e.g. {absolute / 'out'}"
    if not absolute.parent.is_dir():
        if absolute.parent.exists():
            return f"cannot be written: {absolute.parent} is a file, not a directory; give a " \
                   "path in a directory"
        existing = next(p for p in absolute.parents if os.path.lexists(p))
        why = _cannot_create_in(existing)  # mkdir -p would fail there too (/proc, read-only)
        if why is not None:
            return f"cannot be written: {why}; write it somewhere else"
        return f"is in a directory that does not exist ({absolute.parent}): make it first " \
               f"(mkdir -p {absolute.parent}) or write elsewhere"
    why = _cannot_create_in(absolute.parent)
    return None if why is None else f"cannot be written: {why}; write it somewhere else"


def _cannot_create_in(directory: Path) -> str | None:
    """None if a new file can be made in ``directory`` (made and removed at once), else why
    not: only trying tells (a read-only filesystem, /proc, modes that root ignores)."""
    try:
        new_file_beside(directory / ".minigpt-write-check").unlink()
    except OSError as e:
        what = "a read-only filesystem" if e.errno == errno.EROFS else e.strerror
        return f"no file can be created in {directory} ({what})"
    return None


# ----------------------------------------------------------------------------- files and globs

def _has_magic(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def glob_problems(key: str, text: str, pattern: str) -> list[str]:
    """The lines for one entry of an ``INPUT_GLOBS`` field: a file, or a glob that matches at
    least one file and nothing that is not a readable regular file; directories are refused
    unless the glob has ``**`` (which walks into them)."""
    if not _has_magic(pattern):
        if os.path.isdir(pattern):
            return [f"{key}={text} is a directory; use a glob such as "
                    f"'{pattern.rstrip(os.sep)}/*.txt' or '{pattern.rstrip(os.sep)}/**/*'"]
        problem = input_problem(pattern)
        return [_line(key, text, problem)] if problem else []
    walks = "**" in pattern.split(os.sep)
    problems, files = [], 0
    for match in sorted(glob_matches(pattern)):
        if os.path.isdir(match):
            if not walks:
                problems.append(f"{key}={text} matches the directory {match}: narrow the glob "
                                "to files, or use ** to read the files under directories")
            continue
        problem = input_problem(match)
        if problem:
            problems.append(f"{key}={text} matches {match}, which {problem}")
        files += 1
    if not files and not problems:
        where = "" if os.path.isabs(pattern) else f" (cwd: {os.getcwd()})"
        written = next((fix for part, fix in WRITTEN_BY.items() if part in pattern),
                       "check the pattern")
        problems.append(Missing(f"{key}={text} matches no files{where}; {written}"))
    return problems


def expand_paths(patterns: list[str], key: str = "data.paths") -> list[str]:
    """The files ``patterns`` (the value of config key ``key``) name, globs allowed (``**``
    recursive), sorted within each pattern, each file once: by identity (device and inode),
    not by spelling, so a file reached through a symlink or two patterns is read once. A bad
    entry (``glob_problems``) raises one ``PathError`` naming ``key``."""
    lines = [line for i, p in enumerate(patterns)
             for line in glob_problems(f"{key}[{i}]", str(p), os.path.expanduser(str(p)))]
    if lines:
        raise path_error(lines)
    files: list[str] = []
    for pattern in (os.path.expanduser(str(p)) for p in patterns):
        files += sorted(glob_files(pattern)) if _has_magic(pattern) else [pattern]
    return list({_identity(f): f for f in reversed(files)}.values())[::-1]


def _identity(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def glob_files(pattern: str) -> list[str]:
    """The files ``pattern`` matches, as ``glob.glob(pattern, recursive=True)`` finds them,
    except that ``**`` enters each directory once by identity (``glob`` follows a symlink loop
    until the path is too long)."""
    return [p for p in glob_matches(pattern) if os.path.isfile(p)]


def glob_matches(pattern: str) -> list[str]:
    """Every path ``pattern`` matches (``glob_files``' walk): files, directories, and links
    that lead nowhere or to themselves."""
    parts = pattern.split(os.sep)
    fixed = next((i for i, part in enumerate(parts) if _has_magic(part)), len(parts))
    if fixed == len(parts):
        return [pattern] if os.path.lexists(pattern) else []
    root = os.sep.join(parts[:fixed]) if fixed else ""
    if fixed == 1 and not parts[0]:
        root = os.sep  # an absolute pattern such as /*.txt
    return _matches(root, parts[fixed:], set())


def _matches(directory: str, parts: list[str], entered: set) -> list[str]:
    """Paths under ``directory`` ("" for the working directory) that match ``parts``."""
    part, rest = parts[0], parts[1:]
    if part == "**":  # zero directories, then each subdirectory not yet entered at this point
        if not os.path.isdir(directory or os.curdir):
            return []
        found = _matches(directory, rest, entered) if rest else []
        key = (*_identity(directory or os.curdir), len(parts))
        if key in entered:
            return []
        entered.add(key)
        for name in _names(directory, "*"):
            path = os.path.join(directory, name)
            if os.path.isdir(path):
                found += ([path] if not rest else []) + _matches(path, parts, entered)
            elif not rest:
                found.append(path)
        return found
    found = []
    for name in _names(directory, part) if _has_magic(part) else [part]:
        path = os.path.join(directory, name)
        if not rest:
            if os.path.lexists(path):
                found.append(path)
        elif os.path.isdir(path):
            found += _matches(path, rest, entered)
    return found


def _names(directory: str, part: str) -> list[str]:
    """The names in ``directory`` that ``part`` matches; hidden ones only if it starts with a
    dot (as glob does)."""
    try:
        names = os.listdir(directory or os.curdir)
    except OSError:  # not a directory, or unreadable: glob skips it too
        return []
    if not part.startswith("."):
        names = [n for n in names if not n.startswith(".")]
    return fnmatch.filter(names, part)
