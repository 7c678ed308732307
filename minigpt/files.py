"""Files: writing them so that a crash, a kill or a full disk never leaves half a file under the
final name, reading text a user hands us so that bad content is named by file and line, and
tensors without running code from the file."""

from __future__ import annotations

import codecs
import errno
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from minigpt.errors import UserError, first_line

# Below this many free bytes after a failed write, the disk being full is the reason: torch and
# safetensors report a full disk as their own errors, without errno.
NEARLY_FULL = 1 << 20


class DiskFullError(UserError, OSError):
    """A write that did not fit on its filesystem; the message names the file, the bytes it
    needed as far as known, and the fix. The previous file, if any, is unchanged."""


def atomic_write(target: str | os.PathLike, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp)`` on a new temporary file beside ``target``, flush it to disk, then
    rename it over ``target``. On any failure, Ctrl-C included, the temporary file is removed
    and ``target`` is left as it was; a full disk raises ``DiskFullError``."""
    target = Path(target)
    tmp = new_file_beside(target)
    try:
        try:
            write(tmp)
            with open(tmp, "rb+") as f:  # data on disk before the rename makes it visible
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except Exception as e:
            if out_of_space(e, tmp):
                raise disk_full_error(target, tmp) from None
            raise
    finally:
        tmp.unlink(missing_ok=True)


def new_file_beside(target: Path) -> Path:
    """A new, empty ``.<name>.<random>.tmp`` in ``target``'s directory. Opened with mode 0o666
    so that the umask decides its permissions (``tempfile.mkstemp`` makes every file 0600)."""
    for _ in range(100):
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {target}")


def out_of_space(error: BaseException | None, tmp: Path) -> bool:
    """Whether ``error`` (or an error it was raised from) is a full disk or quota, or the
    filesystem holding ``tmp`` is now all but full."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        error = error.__cause__ or error.__context__
    try:
        return shutil.disk_usage(tmp.parent).free < NEARLY_FULL
    except OSError:
        return False


def disk_full_error(target: Path, tmp: Path, written: int | None = None,
                    kept: str | None = None) -> DiskFullError:
    """The one line for ``target`` not fitting; removes ``tmp`` (a file) first. ``written``:
    the bytes the failed write got out, when the caller measured them; ``kept``: what is still
    on disk (default: the previous ``target``, if there is one)."""
    if written is None:
        written = tmp.stat().st_size if tmp.exists() else 0
    tmp.unlink(missing_ok=True)  # first, so that the free space below counts its bytes
    free = shutil.disk_usage(target.parent).free
    if kept is None:
        kept = f"the previous {target.name} is unchanged" if target.exists() else ""
    kept = f"; {kept}" if kept else ""
    error = DiskFullError(
        f"{target}: no space left on the device ({written:,} bytes written before it filled, so "
        f"it needs more than that; {free:,} bytes are free in {target.parent}): free disk space "
        f"there or write to another directory{kept}")
    error.errno = errno.ENOSPC  # for callers that check it (a filename would change str())
    return error


class TextFileError(UserError, ValueError):
    """A file that should hold text does not: the message starts ``<file>:<line>:``."""


# Binary files (images, archives, compiled data) almost always hold a NUL byte early; text never.
SNIFF_BYTES = 8192


def text_lines(path: str | os.PathLike, encoding: str = "utf-8") -> Iterator[tuple[int, str]]:
    """The lines of a text file (endings kept) numbered from 1, decoded one by one: a NUL byte
    or bytes that are not ``encoding`` raise ``TextFileError`` naming the file and line (for
    UTF-16 and UTF-32, decoded whole, the byte offset)."""
    if codecs.lookup(encoding).name.startswith(("utf-16", "utf-32")):
        data = Path(path).read_bytes()
        try:
            text = data.decode(encoding)
        except UnicodeDecodeError as e:
            raise TextFileError(f"{path}: the bytes at offset {e.start} are not {encoding} "
                                "text") from None
        yield from enumerate(text.splitlines(keepends=True), start=1)
        return
    refuse_binary(path)
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode(encoding)
            except UnicodeDecodeError as e:
                raise TextFileError(f"{path}:{number}: byte 0x{raw[e.start]:02x} at column "
                                    f"{e.start + 1} is not {encoding} text") from None
            if "\0" in line:
                raise _binary(path, number)
            yield number, line


Parsed = TypeVar("Parsed")


def read_jsonl(path: str | os.PathLike, parse: Callable[[dict, str], Parsed],
               error: Callable[[str], Exception], limit: int | None = None) -> list[Parsed]:
    """``parse(record, "<file>:<line>")`` of the JSON object on each non-blank line of a UTF-8
    file, the first ``limit`` (all with None). A line that is not text, not JSON or not an
    object raises ``error(message)``, the message naming the file and the line."""
    import json

    parsed = []
    lines = text_lines(path)
    try:
        for number, line in lines:
            if limit is not None and len(parsed) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{where}: not JSON ({e.msg})") from None
            except RecursionError:  # Python's JSON reader recurses once per level of nesting
                raise error(f"{where}: JSON nested too deeply to read") from None
            if not isinstance(record, dict):
                raise error(f"{where}: a JSON {type(record).__name__}, not an object")
            parsed.append(parse(record, where))
    except TextFileError as e:  # binary content or not UTF-8, at the line it names
        raise error(str(e)) from None
    finally:
        lines.close()
    return parsed


def refuse_binary(path: str | os.PathLike) -> None:
    """Raise ``TextFileError`` if the first ``SNIFF_BYTES`` of ``path`` hold a NUL byte (how
    git and grep tell binary files from text), unless a UTF-16 or UTF-32 byte-order mark says
    it is text in one of those (whose characters hold NUL bytes; decoding it names them)."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    if b"\0" in head and not head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE,
                                               codecs.BOM_UTF32_BE)):
        raise _binary(path, head[:head.index(b"\0")].count(b"\n") + 1)


def _binary(path, line: int) -> TextFileError:
    return TextFileError(f"{path}:{line}: binary content (a NUL byte), not text")


def text_problem(path: str | os.PathLike, encoding: str = "utf-8") -> str | None:
    """``<path>:<line>: <what>`` for the first line of ``path`` that is not ``encoding`` text
    (or is binary), or the error reading it; None when all of it is text."""
    try:
        for _ in text_lines(path, encoding):
            pass
    except (TextFileError, OSError) as e:
        return str(e)
    return None


def guess_encoding(path: str | os.PathLike) -> str:
    """What text that is not UTF-8 probably is, from its byte-order mark: a guess for a
    message, never used to read."""
    with open(path, "rb") as f:
        start = f.read(4)
    if start[:2] in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE):
        return "utf-16"
    return "utf-8-sig" if start[:3] == codecs.BOM_UTF8 else "latin-1 or cp1252"


MAX_JSON_DEPTH = 1000  # far deeper than any corpus record; pyarrow's reader crashes on ~10000
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def check_text_files(files: list[str], encoding: str, json: bool = False) -> None:
    """Before a library reads ``files`` as text: ``TextFileError`` naming the file and line of
    binary content (a NUL byte early on) and, with ``json``, of a value nested deeper than
    ``MAX_JSON_DEPTH``, which crashes pyarrow's reader (the process, not an exception)."""
    for path in files:
        if not encoding.lower().replace("_", "-").startswith(("utf-16", "utf-32")):
            refuse_binary(path)  # text in those holds NUL bytes
        if json:
            refuse_deep_json(path)


def refuse_deep_json(path: str | os.PathLike) -> None:
    """``TextFileError`` at the first line of JSON text (one or more values, over any number of
    lines) where brackets outside strings nest deeper than ``MAX_JSON_DEPTH``."""
    depth = 0  # open brackets at the end of the lines so far (a .json file may span lines)
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if b'"' in line:  # JSON strings never span lines, and brackets in them do not count
                line = _JSON_STRING.sub(b'""', line)
            opens, closes = line.count(b"[") + line.count(b"{"), line.count(b"]") + line.count(b"}")
            if depth + opens > MAX_JSON_DEPTH and _deepest(line, depth) > MAX_JSON_DEPTH:
                raise TextFileError(f"{path}:{number}: JSON nested more than {MAX_JSON_DEPTH} "
                                    "levels deep, not a corpus record")
            depth = max(0, depth + opens - closes)


def _deepest(line: bytes, depth: int) -> int:
    deepest = depth
    for bracket in re.findall(rb"[\[\]{}]", line):
        depth += 1 if bracket in (b"[", b"{") else -1
        deepest = max(deepest, depth)
    return deepest


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be read: missing, not minigpt's, or from another format version."""


def load_tensors(path, map_location="cpu", *, mmap: bool = False):
    """``torch.load(path, weights_only=True)``: tensors and plain values, never code; a file
    holding Python objects, or damaged, truncated or foreign, is one ``CheckpointError`` line."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        # not torch's message: it suggests weights_only=False, unsafe for a file from elsewhere
        if "unsupported global" in str(e).lower():
            raise CheckpointError(
                f"{path} holds Python objects besides tensors and plain values (pickled code "
                "could run when loading it); minigpt refused to load it: use a file written by "
                "minigpt (train.py, save_pretrained) or a model.safetensors") from None
        raise CheckpointError(f"{path} is not a readable checkpoint (not a file torch.save "
                              "wrote); a damaged or foreign file reads like this") from None
    except Exception as e:  # zip and I/O errors of a truncated or foreign file come in many types
        raise CheckpointError(f"{path} is not a readable checkpoint ({first_line(e)}); a "
                              "truncated or half-copied file reads like this: copy it again") \
            from None
