"""ChatSession: the cache kept across turns gives the replies of re-reading the history (greedy),
each turn reads only its new tokens, replies stop at the end token, /reset, a full context."""

import pytest
import torch
from chat_helpers import char_tokenizer, chat_template, reread_reply, tiny_chat_model

from minigpt.chat.session import ChatSession, ContextFullError, TextStream

pytestmark = pytest.mark.usefixtures("one_thread")

TURNS = ["what is 2+3?", "and 4+4?", "reverse abc", "thanks."]


def session_for(model, max_new_tokens=12, **options):
    tokenizer = char_tokenizer()
    return ChatSession(model, tokenizer, chat_template(tokenizer),
                       max_new_tokens=max_new_tokens, **options)


def oracle_conversation(model, tokenizer, template, turns, max_new_tokens):
    """Each turn's greedy reply, the whole conversation (replies re-encoded from their text)
    rendered and re-read by the uncached model."""
    messages, replies = [], []
    for text in turns:
        messages.append({"role": "user", "content": text})
        ids = reread_reply(model, template.prompt_ids(messages), template.end_id,
                           tokenizer.eot_id, max_new_tokens)
        replies.append(tokenizer.decode(ids))
        messages.append({"role": "assistant", "content": replies[-1]})
    return replies


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cached_turns_equal_rereading_the_history(seed):
    model = tiny_chat_model(context_length=160, seed=seed)
    session = session_for(model)
    replies = [session.say(t).text for t in TURNS]
    expected = oracle_conversation(model, session.tokenizer, session.template, TURNS, 12)
    assert replies == expected
    assert any(r for r in replies)  # the tiny model says something


def test_each_turn_reads_only_its_new_tokens():
    model = tiny_chat_model(context_length=160)
    session = session_for(model, max_new_tokens=5)
    chunks = []
    forward = model.forward

    def recording(idx, *args, **kwargs):
        chunks.append(idx[0].tolist())
        return forward(idx, *args, **kwargs)

    model.forward = recording
    replies = [session.say(t) for t in TURNS[:3]]
    read = [t for chunk in chunks for t in chunk]
    # everything read, once and in order, is the conversation rendered whole (the last reply's
    # final sampled token is not read: nothing follows it yet)
    last = replies[-1]
    expected = session.template.prompt_ids(session.messages[:-1]) + \
        (last.ids if last.stopped == "end" else last.ids[:-1])
    assert read == expected
    assert session.tokens_read == len(expected)
    # one pass per turn for the new messages, then one token per step
    big = [len(c) for c in chunks if len(c) > 1]
    assert len(big) == 3 and all(len(c) == 1 for c in chunks if len(c) <= 1)
    assert big[0] == len(session.template.prompt_ids(session.messages[:1]))
    assert big[1] < len(session.template.prompt_ids(session.messages[:3])) - 5


def test_reply_stops_at_the_end_token():
    model = tiny_chat_model(context_length=160)
    tokenizer = char_tokenizer()
    template = chat_template(tokenizer)
    with torch.no_grad():  # make the end token the likeliest after "q": the second reply token
        model.lm_head.weight[template.end_id] = 0
    session = ChatSession(model, tokenizer, template, max_new_tokens=30)
    free = session.say("hi")
    assert free.stopped == "length" and len(free.ids) == 30  # the end token never wins
    with torch.no_grad():  # the hidden state after the assistant header points at the end
        model.lm_head.weight[template.end_id] = 10 * model.lm_head.weight[free.ids[3]]
    session.reset()
    reply = session.say("hi")
    assert reply.stopped == "end" and template.end_id not in reply.ids
    assert len(reply.ids) < 30


def test_reset_starts_a_new_conversation():
    model = tiny_chat_model(context_length=160)
    session = session_for(model)
    first = session.say(TURNS[0])
    session.say(TURNS[1])
    session.reset()
    assert session.messages == [] and session.tokens_read == 0
    assert session.say(TURNS[0]).text == first.text
    assert session.tokens_read == len(session.template.prompt_ids(session.messages[:1])) + \
        len(first.ids) - (first.stopped != "end")


def test_context_full_is_said_not_cropped():
    model = tiny_chat_model(context_length=40)
    session = session_for(model, max_new_tokens=30)
    reply = session.say("what is 2+3?")  # 15 prompt tokens, then up to 25 before the context ends
    assert reply.stopped == "context" and session.tokens_read == 40
    before = (list(session.messages), session.tokens_read)
    with pytest.raises(ContextFullError, match=r"context full: .* 40 of .* 40 .*/reset"):
        session.say("more")
    assert (session.messages, session.tokens_read) == before  # nothing lost
    session.reset()
    assert session.say("what is 2+3?").text == reply.text


def test_answer_reads_a_whole_conversation_in_one_pass():
    model = tiny_chat_model(context_length=160)
    session = session_for(model)
    session.say(TURNS[0])
    conversation = [{"role": "system", "content": "be brief."}, *session.messages,
                    {"role": "user", "content": TURNS[1]}]
    fresh = session.answer(conversation)
    tokenizer, template = session.tokenizer, session.template
    expected = reread_reply(model, template.prompt_ids(conversation), template.end_id,
                            tokenizer.eot_id, 12)
    assert fresh.ids == expected


def test_text_stream_waits_for_whole_characters():
    from minigpt.tokenizer import get_tokenizer

    tokenizer = get_tokenizer("gpt2")
    ids = tokenizer.encode("héllo 😀!")
    stream = TextStream(tokenizer.decode)
    pieces = [stream.push(t) for t in ids] + [stream.flush()]
    assert "".join(pieces) == "héllo 😀!"
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # the emoji's bytes span tokens: nothing until the last of them


def test_text_stream_equals_decoding_the_whole_sequence_each_time():
    """Oracle: the text handed out as if every push decoded the whole sequence so far, on
    random GPT-2 tokens (many end inside a character, some bytes are never valid UTF-8) and
    characters; each call decodes a few tokens, not the sequence."""
    import random

    from minigpt.tokenizer import CharTokenizer, get_tokenizer

    rng = random.Random(0)
    gpt2 = get_tokenizer("gpt2")
    byte_tokens = [t for t in range(gpt2.eot_id) if "\ufffd" in gpt2.decode([t])]
    cases = [(gpt2, [rng.choice([rng.randrange(gpt2.eot_id), rng.choice(byte_tokens)])
                     for _ in range(600)]),
             (gpt2, gpt2.encode("naïve café, 東京 and 😀 " * 40)),
             (CharTokenizer("ab\n "), [rng.randrange(4) for _ in range(300)])]
    windows = []  # the length of every part a stream decodes
    for tokenizer, ids in cases:
        stream = TextStream(lambda part, d=tokenizer.decode: windows.append(len(part)) or d(part))
        sent = 0
        for n in range(1, len(ids) + 1):
            whole = tokenizer.decode(ids[:n])
            expected = "" if whole.endswith("\ufffd") else whole[sent:]
            sent = sent if whole.endswith("\ufffd") else len(whole)
            assert stream.push(ids[n - 1]) == expected, n
        assert stream.flush() == tokenizer.decode(ids)[sent:]
        assert max(windows) <= 12  # the tokens since the last text and the piece before


def test_sampling_settings_are_checked():
    model = tiny_chat_model()
    with pytest.raises(ValueError, match="temperature=-1"):
        session_for(model, temperature=-1)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        session_for(model, max_new_tokens=0)


def test_a_sliding_window_model_chats_past_its_context():
    """Rotary positions + a sliding window: the ring cache keeps the last ``window`` tokens, so
    a conversation runs past ``context_length`` and still equals re-reading it whole."""
    model = tiny_chat_model(context_length=32, position="rope", window=16)
    session = session_for(model, max_new_tokens=12)
    replies = [session.say(t).text for t in TURNS]
    assert session.tokens_read > 32 and session.context_length == float("inf")
    expected = oracle_conversation(model, session.tokenizer, session.template, TURNS, 12)
    assert replies == expected
