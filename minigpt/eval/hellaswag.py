"""HellaSwag, scored completion-style (as build-nanogpt and llm.c do): only each ending's tokens
after ``context + " "``; ``acc`` picks the ending with the highest summed log-probability,
``acc_norm`` the highest mean per token. lm-evaluation-harness's version (``minigpt.eval.harness``)
formats the items differently, so its numbers are close but not the same. Items come from a local
jsonl file in HellaSwag's format or the published validation file, downloaded once.
"""

from __future__ import annotations

import contextlib
import logging
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from minigpt.errors import UserError, first_line
from minigpt.eval.scoring import Score, score_pairs
from minigpt.eval.task import Task, evaluate
from minigpt.files import atomic_write, read_jsonl

log = logging.getLogger(__name__)

VALIDATION_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
VALIDATION_FILE = "hellaswag_val.jsonl"
FORMAT = ("a HellaSwag item is one JSON object per line with ctx (or ctx_a and ctx_b), "
          "endings (4 strings) and label (0-3)")


class HellaSwagError(UserError, ValueError):
    """A HellaSwag file or download that cannot be used; the message names the line and the fix."""


@dataclass(frozen=True)
class Item:
    context: str
    endings: tuple[str, ...]
    label: int


@dataclass
class Result:
    """Accuracy by summed (``acc``) and mean (``acc_norm``) log-probability of ``n`` items;
    ``choices``: each item's ending by ``acc_norm``, in item order; ``truncated``: items whose
    context was cut from the left to fit the model's context."""

    acc: float
    acc_norm: float
    n: int
    truncated: int
    choices: list[int] = field(repr=False)


def read_items(path, limit: int | None = None) -> list[Item]:
    """The first ``limit`` items (all with ``None``) of a HellaSwag jsonl file, checked line by
    line: a bad line raises ``HellaSwagError`` naming the file, the line and the field."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"HellaSwag file {path} not found; give path=FILE.jsonl in "
                                "HellaSwag's format, or path=null to download the validation set")
    items = read_jsonl(path, _parse_item, lambda message: HellaSwagError(f"{message}; {FORMAT}"),
                       limit)
    if not items:
        raise HellaSwagError(f"{path} holds no items; {FORMAT}")
    return items


def _parse_item(record: dict, where: str) -> Item:
    if isinstance(record.get("ctx"), str):
        context = record["ctx"]
    elif isinstance(record.get("ctx_a"), str) and isinstance(record.get("ctx_b"), str):
        context = f"{record['ctx_a']} {record['ctx_b']}".strip()
    else:
        raise HellaSwagError(f"{where}: no 'ctx' text (nor 'ctx_a' and 'ctx_b'); {FORMAT}")
    if not context.strip():
        field_name = "ctx" if "ctx" in record else "ctx_a and ctx_b"
        raise HellaSwagError(f"{where}: '{field_name}' is empty: an item's endings are scored "
                             "after its context, which needs some text")
    endings = record.get("endings")
    if not isinstance(endings, list) or not all(isinstance(e, str) for e in endings):
        raise HellaSwagError(f"{where}: no 'endings' list of strings; {FORMAT}")
    if len(endings) != 4:
        raise HellaSwagError(f"{where}: 'endings' has {len(endings)} entries, a HellaSwag item "
                             "has exactly 4")
    label = record.get("label")
    if isinstance(label, str) and label.strip().isdigit():  # the hub dataset stores "0".."3"
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < 4:
        raise HellaSwagError(f"{where}: 'label' is {label!r}, it must be 0, 1, 2 or 3 (the "
                             "index of the right ending)")
    return Item(context, tuple(endings), label)


def download_validation(cache_dir, url: str = VALIDATION_URL) -> Path:
    """HellaSwag's validation file in ``cache_dir``, downloaded from ``url`` the first time
    (written atomically, so an interrupted download is never mistaken for the file)."""
    target = Path(cache_dir) / VALIDATION_FILE
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)

    def fetch(tmp: Path) -> None:
        with urllib.request.urlopen(url, timeout=60) as response:
            tmp.write_bytes(response.read())

    try:
        atomic_write(target, fetch)
    except OSError as e:  # URLError, timeouts and refused connections are all OSErrors
        raise HellaSwagError(f"cannot download HellaSwag's validation set from {url} "
                             f"({first_line(e)}); without a network, copy {VALIDATION_FILE} to "
                             f"{target} or pass a local file with path=FILE.jsonl") from None
    return target


def load_items(path=None, limit: int | None = None, cache_dir="data/eval") -> list[Item]:
    """Items from ``path`` (HellaSwag jsonl), or with ``path=None`` from the validation set
    (downloaded once into ``cache_dir``); the first ``limit`` of them, all with ``None``."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise HellaSwagError(f"limit={limit!r} must be a positive integer or null (all items)")
    return read_items(download_validation(cache_dir) if path is None else path, limit)


class HellaSwag(Task):
    """HellaSwag as a ``Task``: four requests per item (the context, then ``" " + ending``);
    ``acc`` by summed, ``acc_norm`` by mean log-probability; the result lists each item's
    ending by ``acc_norm`` (``choices``)."""

    name = "hellaswag"
    metrics = ("acc", "acc_norm")

    def items(self, limit: int | None = None) -> list[Item]:
        return load_items(self.path, limit, self.cache_dir)

    def check_tokenizer(self, tokenizer) -> None:
        """HellaSwag's set is English scored in BPE tokens (GPT-2's 29.55% acc_norm): a
        character-level model is refused on it, and told once when it scores a file of its
        own."""
        if getattr(tokenizer, "name", None) != "char":
            return
        if self.path is None:
            raise HellaSwagError(
                "HellaSwag's validation set is scored with a BPE tokenizer (GPT-2's), and this "
                "model's tokenizer is character-level: its numbers would compare with none "
                "published; evaluate a model trained with data.tokenizer=gpt2, or give path= a "
                "file of items in your corpus's characters")
        log.warning("HellaSwag items of %s scored with a character-level tokenizer: the "
                    "published numbers are in GPT-2's BPE tokens and do not compare", self.path)

    def requests(self, item: Item, tokenizer) -> list[tuple[list[int], list[int]]]:
        context = tokenizer.encode(item.context)
        return [(context, tokenizer.encode(" " + ending)) for ending in item.endings]

    def item_metrics(self, item: Item, scores: Sequence[Score]) -> dict:
        by_sum = max(range(4), key=lambda k: scores[k].logprob)
        by_mean = max(range(4), key=lambda k: scores[k].logprob / scores[k].tokens)
        return {"acc": float(by_sum == item.label), "acc_norm": float(by_mean == item.label),
                "choice": by_mean}

    def summary(self, per_item: list[dict]) -> dict:
        return {"choices": [r["choice"] for r in per_item]}


def item_scores(model, tokenizer, items: Sequence[Item], *, batch_size: int = 16, device="cpu",
                autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                progress: Callable[[int], None] | None = None,
                through_forward: bool = False) -> tuple[list[list[Score]], int]:
    """The four endings' ``Score``s of each item (``score_pairs``: each context runs once), and
    how many items had their context cut from the left to fit the model. ``batch_size``: items
    per forward pass; ``progress(k)``: after each batch of ``k`` endings."""
    pairs = [pair for item in items for pair in HellaSwag().requests(item, tokenizer)]
    scores, cut = score_pairs(model, pairs, batch_size=4 * batch_size, device=device,
                              autocast=autocast, progress=progress,
                              through_forward=through_forward)
    return ([scores[i:i + 4] for i in range(0, len(pairs), 4)],
            sum(any(cut[i:i + 4]) for i in range(0, len(pairs), 4)))


def score_items(model, tokenizer, items: Sequence[Item], *, batch_size: int = 16, device="cpu",
                autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                progress: bool = False, through_forward: bool = False) -> Result:
    """Score ``items`` with ``model`` (a ``GPT``); ``batch_size`` items (four rows each) per
    forward pass. See ``score_rows`` for ``autocast`` and ``through_forward``; ``progress``
    shows a bar on stderr."""
    result = evaluate(HellaSwag(), model, tokenizer, items, batch_size=batch_size, device=device,
                      autocast=autocast, progress=progress, through_forward=through_forward)
    return Result(result["acc"], result["acc_norm"], result["n"], result["truncated"],
                  result["choices"])
