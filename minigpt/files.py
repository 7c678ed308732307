"""Writing files so that a crash or kill never leaves half a file under the final name."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(target: str | os.PathLike, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``target``, flush it to disk, then rename
    it over ``target`` (atomic within one filesystem). On any failure, Ctrl-C included, the
    temporary file is removed and ``target`` is left as it was."""
    target = Path(target)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:  # data on disk before the rename makes it visible
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
