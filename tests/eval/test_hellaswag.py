"""HellaSwag scoring against an independent oracle: transformers' GPT2LMHeadModel on the same
weights, each ending scored by hand; and the item file's one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from eval_helpers import hf_model, tiny_model, write_items

from minigpt.eval import HellaSwagError, load_items, read_items, score_items
from minigpt.eval.hellaswag import download_validation
from minigpt.tokenizer import get_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def reference(hf, tok, records, context_length):
    """Per item: the four endings' summed and mean losses, from the Hugging Face model run on
    one row at a time, the context cut from the left to fit ``context_length + 1`` tokens."""
    out = []
    for r in records:
        ctx = tok.encode(r.get("ctx") or f"{r['ctx_a']} {r['ctx_b']}")
        losses = []
        for ending in r["endings"]:
            end = tok.encode(" " + ending)
            row = (ctx + end)[-(context_length + 1):]
            with torch.no_grad():
                logits = hf(torch.tensor([row[:-1]])).logits[0]
            loss = F.cross_entropy(logits, torch.tensor(row[1:]), reduction="none")[-len(end):]
            losses.append((loss.sum().item(), loss.mean().item()))
        out.append(losses)
    return out


def expected(ref, records):
    by_sum = [min(range(4), key=lambda k: four[k][0]) for four in ref]
    by_mean = [min(range(4), key=lambda k: four[k][1]) for four in ref]
    labels = [int(r["label"]) for r in records]
    n = len(records)
    return (sum(a == b for a, b in zip(by_sum, labels, strict=True)) / n,
            sum(a == b for a, b in zip(by_mean, labels, strict=True)) / n, by_mean)


@pytest.mark.parametrize("context_length", [64, 16])
def test_matches_gpt2lmheadmodel_scored_by_hand(tmp_path, context_length):
    records = write_items(tmp_path / "hs.jsonl")
    model = tiny_model(context_length)
    hf = hf_model(model, tmp_path / "hf")
    tok = get_tokenizer("gpt2")
    ref = reference(hf, tok, records, context_length)
    # the oracle separates the endings by far more than float rounding, so choices are stable
    assert min(sorted(x[1] for x in four)[1] - sorted(x[1] for x in four)[0] for four in ref) > 1e-4

    result = score_items(model, tok, read_items(tmp_path / "hs.jsonl"), batch_size=3)
    acc, acc_norm, choices = expected(ref, records)
    assert (result.acc, result.acc_norm, result.choices) == (acc, acc_norm, choices)
    assert result.n == len(records)
    cut = sum(len(tok.encode(r.get("ctx") or f"{r['ctx_a']} {r['ctx_b']}")) +
              max(len(tok.encode(" " + e)) for e in r["endings"]) > context_length + 1
              for r in records)
    assert result.truncated == cut and (cut > 0) == (context_length == 16)


def test_batch_size_changes_nothing(tmp_path):
    write_items(tmp_path / "hs.jsonl")
    items = read_items(tmp_path / "hs.jsonl")
    model, tok = tiny_model(), get_tokenizer("gpt2")
    one = score_items(model, tok, items, batch_size=1)
    many = score_items(model, tok, items, batch_size=64)
    assert (one.acc, one.acc_norm, one.choices) == (many.acc, many.acc_norm, many.choices)


def _line(tmp_path, text):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 0})
    path.write_text(good + "\n" + text + "\n")
    return path


@pytest.mark.parametrize("text, message", [
    ("{not json", r"bad.jsonl:2: not JSON"),
    ('{"endings": ["b", "c", "d", "e"], "label": 1}', r"bad.jsonl:2: no 'ctx' text"),
    ('{"ctx": "a", "label": 1}', r"bad.jsonl:2: no 'endings' list"),
    ('{"ctx": "a", "endings": ["b", "c", "d"], "label": 1}', r"bad.jsonl:2: 'endings' has 3 "
                                                             r"entries.*exactly 4"),
    ('{"ctx": "a", "endings": ["b", "c", "d", "e"]}', r"bad.jsonl:2: 'label' is None"),
    ('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 4}', r"'label' is 4, it must be"),
    ('[1, 2]', r"bad.jsonl:2: a JSON list, not an object"),
    ('{"ctx": "", "endings": ["b", "c", "d", "e"], "label": 1}', r"bad.jsonl:2: 'ctx' is empty"),
    ('{"ctx_a": " ", "ctx_b": "", "endings": ["b", "c", "d", "e"], "label": 1}',
     r"bad.jsonl:2: 'ctx_a and ctx_b' is empty"),
])
def test_bad_lines_name_file_line_and_field(tmp_path, text, message):
    with pytest.raises(HellaSwagError, match=message):
        read_items(_line(tmp_path, text))


@pytest.mark.parametrize("content, message", [
    ('{"ctx": ' + "[" * 100_000 + "]" * 100_000 + "}", r"bad.jsonl:2: JSON nested too deeply"),
    (b"\x1f\x8b\x08\x00\x00\x00", r"bad.jsonl:2: binary content \(a NUL byte\), not text"),
    (b'{"ctx": "caf\xe9"}', r"bad.jsonl:2: byte 0xe9 at column 13 is not utf-8 text"),
])
def test_deep_binary_and_undecodable_lines_name_file_and_line(tmp_path, content, message):
    path = _line(tmp_path, "")
    path.write_bytes(path.read_bytes().rstrip(b"\n") + b"\n" + (
        content if isinstance(content, bytes) else content.encode()) + b"\n")
    with pytest.raises(HellaSwagError, match=message) as error:
        read_items(path)
    assert "\n" not in str(error.value) and "one JSON object per line" in str(error.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl not found.*path="):
        read_items(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(HellaSwagError, match="holds no items"):
        read_items(tmp_path / "empty.jsonl")
    with pytest.raises(HellaSwagError, match="limit=0 must be a positive integer"):
        load_items(tmp_path / "empty.jsonl", limit=0)


def test_download_once_then_cached(tmp_path):
    source = tmp_path / "published.jsonl"
    write_items(source, n=3)
    cached = download_validation(tmp_path / "cache", url=source.as_uri())
    assert cached.read_text() == source.read_text()
    source.unlink()  # a second call reads the cache, never the network
    assert download_validation(tmp_path / "cache", url=source.as_uri()) == cached
    assert len(load_items(None, cache_dir=tmp_path / "cache")) == 3


def test_download_failure_says_how_to_pass_a_local_file(tmp_path):
    with pytest.raises(HellaSwagError, match=r"cannot download.*path=FILE.jsonl"):
        download_validation(tmp_path / "cache", url=(tmp_path / "missing.jsonl").as_uri())
    assert not list((tmp_path / "cache").iterdir())  # no half-written file left behind


def test_a_request_with_nothing_to_score_after_is_one_line_naming_the_item():
    """A task of one's own whose item tokenizes to an empty context: one line naming the task
    and the item, not the scorer's internal check."""
    from minigpt.errors import UserError
    from minigpt.eval.task import Task, evaluate

    class Blank(Task):
        name = "blank"
        metrics = ("acc",)

        def requests(self, item, tokenizer):
            return [(tokenizer.encode(item), tokenizer.encode(" yes"))]

    with pytest.raises(UserError, match=r"^blank: item 1 \(request 0\) has an empty context "
                                        r"after tokenizing"):
        evaluate(Blank(), tiny_model(), get_tokenizer("gpt2"), ["Is it?", ""])


def test_a_character_level_model_is_refused_on_hellaswags_set(tmp_path, caplog):
    from minigpt.eval.hellaswag import HellaSwag
    from minigpt.eval.task import evaluate
    from minigpt.model import GPT, GPTConfig
    from minigpt.tokenizer import CharTokenizer

    records = write_items(tmp_path / "items.jsonl")
    chars = CharTokenizer(sorted({c for r in records for c in json.dumps(r)} | {" "}))
    model = GPT(GPTConfig(vocab_size=128, context_length=64, n_layer=2, n_head=2, n_embd=32))
    with pytest.raises(HellaSwagError, match=r"scored with a BPE tokenizer \(GPT-2's\), and this "
                                             r"model's tokenizer is character-level"):
        evaluate(HellaSwag(None, tmp_path / "cache"), model, chars, [])
    task = HellaSwag(str(tmp_path / "items.jsonl"))  # the user's own items: scored, with a word
    result = evaluate(task, model.eval(), chars, task.items(2))
    assert result["n"] == 2
    assert "scored with a character-level tokenizer" in caplog.text
