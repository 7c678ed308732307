"""The chat template against ids and masks spelled out by hand."""

import pytest

from minigpt.chat.template import ChatFormatError, ChatTemplate, read_chat_template
from minigpt.tokenizer import CharTokenizer, get_tokenizer

# characters a=0, b=1, c=2; end-of-text 3; then <|system|> 4, <|user|> 5, <|assistant|> 6, <|end|> 7
CHARS = CharTokenizer("abc")
CONVERSATION = [{"role": "system", "content": "a"}, {"role": "user", "content": "ab"},
                {"role": "assistant", "content": "c"}, {"role": "user", "content": "b"},
                {"role": "assistant", "content": "ba"}]


def test_char_render_ids_and_mask_by_hand():
    ids, mask = ChatTemplate.for_tokenizer(CHARS).render(CONVERSATION)
    assert ids == [3, 4, 0, 7, 5, 0, 1, 7, 6, 2, 7, 5, 1, 7, 6, 1, 0, 7]
    F, T = False, True
    assert mask == [F, F, F, F, F, F, F, F, F, T, T, F, F, F, F, T, T, T]


def test_prompt_ids_and_cache_invariant():
    template = ChatTemplate.for_tokenizer(CHARS)
    assert template.prompt_ids(CONVERSATION[:2]) == [3, 4, 0, 7, 5, 0, 1, 7, 6]
    assert (template.end_id, template.assistant_id, template.bos_id) == (7, 6, 3)
    history, reply, user = CONVERSATION[:2], CONVERSATION[2], CONVERSATION[3]
    assert template.prompt_ids([*history, reply, user]) == (
        template.prompt_ids(history) + [2, template.end_id] + template.message_ids(user)
        + [template.assistant_id])


def test_gpt2_ids_sit_in_the_padded_vocabulary():
    template = ChatTemplate.for_tokenizer(get_tokenizer("gpt2"))
    ids, mask = template.render([{"role": "user", "content": "hello"},
                                 {"role": "assistant", "content": " world"}])
    assert ids == [50256, 50258, 31373, 50260, 50259, 995, 50260]
    assert mask == [False, False, False, False, False, True, True]
    assert template.min_vocab_size == 50261 <= 50304
    assert template.decode(ids) == "<|endoftext|><|user|>hello<|end|><|assistant|> world<|end|>"


def test_round_trip_through_dict_and_metadata():
    template = ChatTemplate.for_tokenizer(CHARS)
    back = read_chat_template({"chat_template": template.to_dict()}, CHARS)
    assert back.render(CONVERSATION) == template.render(CONVERSATION)
    assert read_chat_template({}, CHARS) is None
    with pytest.raises(ChatFormatError, match="format 'other'"):
        ChatTemplate.from_dict({"format": "other"}, CHARS)


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"),
    ([{"role": "bot", "content": "a"}], "message 0 field 'role' is 'bot'"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": 3}],
     "message 1 field 'content' is int"),
    ([{"role": "user", "content": "xyz"}], "message 0 field 'content'.*'x'"),
])
def test_bad_messages_name_the_message_and_field(messages, match):
    with pytest.raises(ChatFormatError, match=match):
        ChatTemplate.for_tokenizer(CHARS).render(messages)
