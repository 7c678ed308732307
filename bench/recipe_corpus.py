"""A corpus of many documents shorter than a row, for the document rungs of the recipe lab.

``shakespeare_paragraphs`` yields every paragraph (a blank-line separated block: a speech, a
stage direction, a heading) of Shakespeare's plays (``minigpt.data.shakespeare``) as its own
document: about 39,000 documents, a median of 20 GPT-2 tokens and 99% under 270, so a row of 512
tokens packs many of them. Named as ``data.source`` by ``configs/data/shakespeare_paragraphs.yaml``.
"""

from __future__ import annotations

from collections.abc import Iterator


def shakespeare_paragraphs() -> Iterator[str]:
    """The paragraphs of every play, in the plays' sorted order, each ending with a newline."""
    from minigpt.data.shakespeare import read_plays

    for _, text in read_plays():
        for paragraph in text.split("\n\n"):
            if paragraph.strip():
                yield paragraph.strip("\n") + "\n"


shakespeare_paragraphs.version = 1  # raise when the documents change (the data fingerprint)
