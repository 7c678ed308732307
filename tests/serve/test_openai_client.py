"""The official ``openai`` Python client against the server: completions, chat completions,
streaming, and an error it raises as its own exception type."""

import openai
import pytest
from chat_helpers import char_tokenizer, chat_template, reread_reply, tiny_chat_model

from tests.serve.conftest import CONTEXT


@pytest.fixture
def client(server_url):
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)


def chat_oracle(messages, max_tokens):
    """The reply the tiny chat model gives greedily, re-reading the whole conversation per
    token (tests/chat_helpers.py's oracle)."""
    tokenizer = char_tokenizer()
    template = chat_template(tokenizer)
    ids = reread_reply(tiny_chat_model(CONTEXT, seed=1), template.prompt_ids(messages),
                       template.end_id, tokenizer.eot_id, max_tokens)
    return tokenizer.decode(ids)


def test_models_and_completions(client):
    [model] = client.models.list().data
    assert model.model_extra["context_length"] == CONTEXT and model.model_extra["chat"] is True
    result = client.completions.create(model=model.id, prompt="abc", max_tokens=6,
                                       temperature=0)
    assert result.object == "text_completion" and len(result.choices[0].text) == 6
    assert result.usage.prompt_tokens == 3 and result.usage.completion_tokens == 6


def test_chat_completion_and_its_stream(client):
    messages = [{"role": "user", "content": "what is 2+2?"}]
    expected = chat_oracle(messages, 10)
    reply = client.chat.completions.create(model="any", messages=messages, max_tokens=10,
                                           temperature=0)
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.completion_tokens == len(expected)
    chunks = list(client.chat.completions.create(
        model="any", messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[-1].usage.total_tokens == reply.usage.total_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_completion_stream(client):
    whole = client.completions.create(model="m", prompt="xyz", max_tokens=8, temperature=0)
    parts = client.completions.create(model="m", prompt="xyz", max_tokens=8, temperature=0,
                                      stream=True)
    assert "".join(c.choices[0].text for c in parts) == whole.choices[0].text


def test_an_error_is_the_clients_exception(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="m", prompt="a" * (CONTEXT + 1), max_tokens=1)
    assert error.value.status_code == 400
    assert error.value.code == "context_length_exceeded"
    assert "96 tokens" in error.value.message


def test_several_prompts_and_choices(client):
    result = client.completions.create(model="m", prompt=["ab", "xyz"], n=2, max_tokens=4,
                                       temperature=1.0, seed=5)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert result.usage.prompt_tokens == 5  # each prompt once, not once per choice
    again = client.completions.create(model="m", prompt=["ab", "xyz"], n=2, max_tokens=4,
                                      temperature=1.0, seed=5)
    assert [c.text for c in again.choices] == [c.text for c in result.choices]  # seeded
