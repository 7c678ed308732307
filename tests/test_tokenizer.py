"""Tokenizers: tiktoken by name, the character tokenizer, the dict round trip, the offline error."""

import io
import json

import numpy as np
import pytest
import torch

from minigpt.tokenizer import (
    EOT_TEXT,
    CharTokenizer,
    TiktokenTokenizer,
    TokenizerUnavailableError,
    get_tokenizer,
    tokenizer_from_dict,
)


def _tiktoken_or_skip(name: str = "gpt2") -> TiktokenTokenizer:
    try:
        return get_tokenizer(name)
    except TokenizerUnavailableError as e:
        pytest.skip(f"tiktoken encoding {name!r} unavailable (set TIKTOKEN_CACHE_DIR): {e}")


TEXTS = ["Hello world", "", "O Romeo, Romeo!\nwherefore art thou Romeo?", "a <|endoftext|> b", "é ☃ 日本"]


def test_gpt2_known_ids_and_round_trip():
    tok = _tiktoken_or_skip("gpt2")
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("gpt2", 50257, 50256)
    assert tok.encode("Hello world") == [15496, 995]
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode([tok.eot_id]) == EOT_TEXT


def test_tiktoken_special_token_text_is_ordinary_text():
    tok = _tiktoken_or_skip("gpt2")
    ids = tok.encode("a <|endoftext|> b")
    assert tok.eot_id not in ids


def test_tiktoken_encode_batch_matches_encode():
    tok = _tiktoken_or_skip("gpt2")
    for threads in (1, 2):
        batch = tok.encode_batch(TEXTS, num_threads=threads)
        assert [b.tolist() for b in batch] == [tok.encode(t) for t in TEXTS]
        assert all(b.dtype == np.uint32 for b in batch)


def test_tiktoken_tokenizer_pickles_and_survives_fork():
    import os
    import pickle

    tok = _tiktoken_or_skip("gpt2")
    tok.encode_batch(TEXTS, num_threads=2)  # start the worker threads in this process
    again = pickle.loads(pickle.dumps(tok))
    assert again.encode_batch(TEXTS[:2], num_threads=2)[0].tolist() == tok.encode(TEXTS[0])
    if not hasattr(os, "fork"):
        return
    pid = os.fork()
    if pid == 0:  # the child inherits the pool object but not its threads: must not hang
        ok = tok.encode_batch(TEXTS, num_threads=2)[0].tolist() == [15496, 995]
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_r50k_base_loads():
    tok = _tiktoken_or_skip("r50k_base")
    assert tok.vocab_size == 50257
    assert tok.encode("Hello world") == [15496, 995]


def test_tiktoken_dict_round_trip():
    tok = _tiktoken_or_skip("gpt2")
    d = tok.to_dict()
    assert json.loads(json.dumps(d)) == d
    again = tokenizer_from_dict(d)
    assert isinstance(again, TiktokenTokenizer) and again.encode("Hello") == tok.encode("Hello")


def test_tokenizer_from_dict_rejects_a_changed_vocabulary():
    tok = _tiktoken_or_skip("gpt2")
    with pytest.raises(ValueError, match="vocab_size=50257.*saved with vocab_size=50000"):
        tokenizer_from_dict({**tok.to_dict(), "vocab_size": 50000})


def test_offline_without_cache_is_one_clear_line(monkeypatch, tmp_path):
    import tiktoken.load

    def no_network(url):
        raise ConnectionError(f"Failed to resolve host for {url}\nsecond line of noise")

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # empty: nothing cached
    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    with pytest.raises(TokenizerUnavailableError) as info:
        get_tokenizer("o200k_base")
    message = str(info.value)
    assert "\n" not in message
    assert "TIKTOKEN_CACHE_DIR" in message and "data=shakespeare_char" in message
    assert "'o200k_base'" in message
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert isinstance(info.value, RuntimeError)


def test_unknown_tokenizer_name():
    with pytest.raises(ValueError, match="unknown tokenizer 'gpt5'"):
        get_tokenizer("gpt5")


def test_char_tokenizer_vocabulary_and_round_trip():
    tok = CharTokenizer.from_text(["hello", "world\n"])
    assert tok.chars == sorted(set("helloworld\n"))
    assert tok.eot_id == len(tok.chars) and tok.vocab_size == len(tok.chars) + 1
    ids = tok.encode("hello world\n".replace(" ", ""))
    assert ids == [tok.chars.index(c) for c in "helloworld\n"]
    assert tok.decode(ids + [tok.eot_id]) == "helloworld\n" + EOT_TEXT
    assert [a.tolist() for a in tok.encode_batch(["hold", "", "low"])] == [
        tok.encode("hold"), [], tok.encode("low")]


def test_char_tokenizer_names_unknown_characters():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match=r"2 character\(s\) not in .*'Z', '€'"):
        tok.encode("abZ€")
    with pytest.raises(ValueError, match="'Z'"):
        tok.encode_batch(["abc", "Z"])
    with pytest.raises(ValueError, match="'☃'"):  # beyond the lookup table's code points
        tok.encode_batch(["☃"])
    with pytest.raises(ValueError, match="outside the character vocabulary"):
        tok.decode([99])


def test_char_tokenizer_dict_survives_json_and_weights_only_torch_load():
    tok = get_tokenizer("char", text="To be, or not to be:\nthat is the question.")
    d = tok.to_dict()
    buf = io.BytesIO()
    torch.save({"tokenizer": d}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["tokenizer"]
    assert json.loads(json.dumps(loaded)) == d
    again = tokenizer_from_dict(loaded)
    assert again.chars == tok.chars and again.eot_id == tok.eot_id
    assert again.encode("question") == tok.encode("question")


def test_char_tokenizer_needs_a_corpus():
    with pytest.raises(ValueError, match="text=... or chars="):
        get_tokenizer("char")
    with pytest.raises(ValueError, match="empty"):
        CharTokenizer.from_text("")
