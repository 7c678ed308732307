"""Reading conversation records: both forms, and bad records named by file, line and field."""

from __future__ import annotations

import json

import pytest
import torch

from minigpt.chat.template import ChatTemplate
from minigpt.data.chat import (
    ChatDataError,
    ChatSettings,
    read_conversations,
    read_jsonl,
    render_all,
)
from minigpt.data.config import DataConfig, DataError
from minigpt.model import GPT, GPTConfig
from minigpt.tokenizer import CharTokenizer
from minigpt.train.model_init import grow_vocab


def write(path, *records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_both_forms_read_as_messages(tmp_path):
    path = write(tmp_path / "a.jsonl",
                 {"messages": [{"role": "user", "content": "hi"},
                               {"role": "assistant", "content": "yo"}]},
                 "",
                 {"instruction": "Add", "input": "1 2", "output": "3"},
                 {"instruction": "Wave", "output": "ok"})
    records = list(read_jsonl(path))
    assert [where for where, _ in records] == [f"{path}:1", f"{path}:3", f"{path}:4"]
    assert records[1][1] == [{"role": "user", "content": "Add\n\n1 2"},
                             {"role": "assistant", "content": "3"}]
    assert records[2][1][0] == {"role": "user", "content": "Wave"}


@pytest.mark.parametrize("line, match", [
    ('{"messages": [', r":2: not JSON"),
    ('{"text": "x"}', r":2: no field 'messages' or 'instruction' \(fields: text\)"),
    ('{"instruction": "x"}', r":2: field 'output' is missing"),
    ('{"instruction": "x", "output": "y", "input": 3}', r":2: field 'input' is int"),
    ('[1]', r":2: a JSON list, not an object"),
])
def test_bad_records_name_file_line_and_field(tmp_path, line, match):
    path = write(tmp_path / "bad.jsonl", {"instruction": "a", "output": "b"}, line)
    with pytest.raises(ChatDataError, match=f"bad.jsonl{match}"):
        list(read_jsonl(path))


def test_bad_message_is_named_with_its_line(tmp_path):
    path = write(tmp_path / "m.jsonl", {"messages": [{"role": "user", "content": "ab"}]},
                 {"messages": [{"role": "user", "content": "a"}, {"role": "robot",
                                                                  "content": "b"}]})
    template = ChatTemplate.for_tokenizer(CharTokenizer("ab"))
    with pytest.raises(ChatDataError, match=r"m.jsonl:2: message 1 field 'role' is 'robot'"):
        render_all(template, list(read_jsonl(path)), "assistant")


def test_held_out_fraction_is_fixed_and_disjoint(tmp_path):
    path = write(tmp_path / "c.jsonl", *({"instruction": str(i), "output": "x"}
                                         for i in range(20)))
    config = DataConfig(name="chat", source="chat", paths=[path], val_fraction=0.25)
    train, val = read_conversations(config, ChatSettings())
    assert (len(train), len(val)) == (15, 5)
    assert not {w for w, _ in train} & {w for w, _ in val}
    assert read_conversations(config, ChatSettings())[1] == val


def test_bad_settings_in_one_line():
    with pytest.raises(DataError, match=r"unknown data.source_args.oops.*train_on='x' must be"):
        ChatSettings.from_args({"oops": 1, "train_on": "x"})


def test_grow_vocab_keeps_old_rows_and_adds_their_mean():
    torch.manual_seed(0)
    for tie in (True, False):
        model = GPT(GPTConfig(vocab_size=10, context_length=8, n_layer=1, n_head=2, n_embd=8,
                              tie_head=tie))
        grown = grow_vocab(model, 16)
        assert grown.config.vocab_size == 16
        old, new = model.tok_emb.weight, grown.tok_emb.weight
        torch.testing.assert_close(new[:10], old)
        torch.testing.assert_close(new[10:], old.mean(0).expand(6, 8))
        head = grown.lm_head.weight
        assert (head is new) == tie
        torch.testing.assert_close(head[10:], model.lm_head.weight.mean(0).expand(6, 8))
        idx = torch.tensor([[1, 2, 3]])  # old tokens: the same logits over the old rows
        torch.testing.assert_close(grown(idx)[..., :10], model(idx))


def test_preparing_chat_data_says_train_py_renders_it(tmp_path):
    from minigpt.data import prepare_dataset

    path = write(tmp_path / "c.jsonl", {"instruction": "a", "output": "b"})
    with pytest.raises(DataError, match="source=chat.*nothing to prepare"):
        prepare_dataset(DataConfig(name="chat", source="chat", paths=[path]), tmp_path,
                        progress=False)


def test_a_hugging_face_gpt2_is_grown_for_the_template(tmp_path, caplog):
    from minigpt.config.schema import ModelSchema
    from minigpt.tokenizer import get_tokenizer
    from minigpt.train.model_init import init_model

    torch.manual_seed(0)
    small = GPT(GPTConfig(vocab_size=50257, context_length=8, n_layer=1, n_head=2, n_embd=8))
    small.save_pretrained(str(tmp_path / "gpt2"))
    template = ChatTemplate.for_tokenizer(get_tokenizer("gpt2"))
    model = init_model(ModelSchema(init_from=str(tmp_path / "gpt2"), context_length=8),
                       template.tokenizer, 50304,
                       min_vocab=template.min_vocab_size)
    assert model.config.vocab_size == 50304 and model.lm_head.weight is model.tok_emb.weight
    torch.testing.assert_close(model.tok_emb.weight[:50257], small.tok_emb.weight)
    torch.testing.assert_close(model.tok_emb.weight[template.end_id],
                               small.tok_emb.weight.mean(0))
    assert "grew the embedding of" in caplog.text and "from 50257 to 50304 rows" in caplog.text
