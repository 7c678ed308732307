"""A sequence's text as it goes out: stop strings end it (found across token boundaries, never
sent in part), text goes out only at complete UTF-8 characters, and the pieces add up to the
whole text (the oracle: the text decoded at once and cut at the first stop string)."""

import pytest
import torch

from minigpt.serve.sequence import SamplingParams, Sequence, StopText
from minigpt.tokenizer import CharTokenizer, get_tokenizer


def run(ids, decode, **params):
    events = []
    sequence = Sequence([0], SamplingParams(temperature=0, **params), end_ids={-1},
                        allowed=torch.zeros(1), decode=decode, sink=events.append)
    for token in ids:
        if sequence.accept(token, None):
            break
    return events


def cut(text: str, stops) -> str:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[:min(found)] if found else text


@pytest.mark.parametrize("stops", [("cd",), ("xyz", "bc d"), ("d e",), ("zz",), ("a",)])
def test_stop_strings_across_tokens(stops):
    tokenizer = CharTokenizer("abcdefgh xyz")
    text = "ab bc de fgh"
    events = run(tokenizer.encode(text), tokenizer.decode, max_tokens=len(text), stop=stops)
    assert "".join(e.text for e in events) == cut(text, stops)
    for n in range(1, len(events)):  # nothing sent before the end could start a stop string
        sent = "".join(e.text for e in events[:n])
        assert cut(sent, stops) == sent
    assert events[-1].finish_reason == ("stop" if cut(text, stops) != text else "length")


def test_stop_text_holds_a_possible_start():
    stop = StopText(("hello",))
    assert stop.push("say hel") == ("say ", False)
    assert stop.push("lo there") == ("", True)


def test_text_goes_out_at_whole_characters():
    tokenizer = get_tokenizer("gpt2")
    text = "日本語のテキスト, naïve café"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # characters split over tokens
    events = run(ids, tokenizer.decode, max_tokens=len(ids))
    assert all("\ufffd" not in e.text for e in events)
    assert "".join(e.text for e in events) == text
    assert events[-1].completion_tokens == len(ids)
