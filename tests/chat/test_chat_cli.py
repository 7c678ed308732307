"""``generate.py chat=true``: the file mode (replies and exact match against the oracle), the
interactive mode driven through stdin in a subprocess, and one-line errors for bad input."""

import importlib.util
import io
import json
import os
import subprocess
import sys

import pytest
from chat_helpers import (
    ROOT,
    char_tokenizer,
    chat_template,
    reread_reply,
    save_chat_checkpoint,
    tiny_chat_model,
)
from hydra import compose, initialize_config_dir

from minigpt.chat.template import ChatFormatError
from minigpt.errors import UserError

_spec = importlib.util.spec_from_file_location("generate_cli", ROOT / "generate.py")
generate_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate_cli)

pytestmark = pytest.mark.usefixtures("one_thread")
QUESTIONS = ["what is 2+3?", "reverse abc", "hello", "say yes."]


@pytest.fixture
def chat_ckpt(tmp_path):
    tokenizer = char_tokenizer()
    model = tiny_chat_model(context_length=160)
    template = chat_template(tokenizer)
    return save_chat_checkpoint(tmp_path / "chat.ckpt", model, tokenizer, template), model, \
        tokenizer, template


def config(*overrides):
    """generate.py's config; float32, as the oracle computes (auto may pick bfloat16)."""
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("generate", overrides=["dtype=float32", *overrides])


def oracle(model, tokenizer, template, messages, max_new_tokens=10):
    ids = reread_reply(model, template.prompt_ids(messages), template.end_id, tokenizer.eot_id,
                       max_new_tokens)
    return tokenizer.decode(ids)


def test_file_mode_writes_replies_and_scores_exact_match(chat_ckpt, tmp_path, capsys):
    path, model, tokenizer, template = chat_ckpt
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    right = oracle(model, tokenizer, template, conversations[0])
    conversations[0].append({"role": "assistant", "content": f" {right}\n"})  # spaces aside
    conversations[1].append({"role": "assistant", "content": "cba"})  # not what it says
    two_turns = [{"role": "system", "content": "be brief."}, *conversations[0],
                 {"role": "user", "content": "and 4+4?"}]
    conversations.append(two_turns)
    source = tmp_path / "val.jsonl"
    source.write_text("".join(json.dumps({"messages": c}) + "\n\n" for c in conversations))
    out = tmp_path / "replies.jsonl"
    generate_cli.run(config(f"ckpt_path={path}", "chat=true", f"chat_input={source}",
                            f"chat_output={out}", "temperature=0", "max_new_tokens=10"))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["reference"] for r in records] == [f" {right}\n", "cba", None, None, None]
    prompts = [c[:-1] if c[-1]["role"] == "assistant" else c for c in conversations]
    assert [r["reply"] for r in records] == [oracle(model, tokenizer, template, p)
                                             for p in prompts]
    assert records[1]["reply"] != "cba"
    assert "exact match: 1/2 = 0.5000" in capsys.readouterr().err


def test_a_base_model_has_no_template(chat_ckpt, tmp_path):
    _, model, tokenizer, template = chat_ckpt
    base = save_chat_checkpoint(tmp_path / "base.ckpt", model, tokenizer)
    source = tmp_path / "val.jsonl"
    source.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    args = [f"ckpt_path={base}", "chat=true", f"chat_input={source}", "temperature=0",
            "max_new_tokens=4"]
    with pytest.raises(UserError, match=r"base\.ckpt has no chat template: .*experiment=sft.*"
                                        r"chat_template=default"):
        generate_cli.run(config(*args))
    result = generate_cli.run(config(*args, f"chat_output={tmp_path / 'out.jsonl'}",
                                     "chat_template=default"))
    assert result == []
    reply = json.loads((tmp_path / "out.jsonl").read_text())["reply"]
    assert reply == oracle(model, tokenizer, template, [{"role": "user", "content": "hello"}], 4)


def test_bad_conversation_file_names_line_and_field(chat_ckpt, tmp_path):
    path = chat_ckpt[0]
    source = tmp_path / "bad.jsonl"
    source.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n" +
                      json.dumps({"messages": [{"role": "robot", "content": "hi"}]}) + "\n")
    with pytest.raises(ChatFormatError, match=r"bad\.jsonl:2: message 0 field 'role' is "
                                              r"'robot'"):
        generate_cli.run(config(f"ckpt_path={path}", "chat=true", f"chat_input={source}"))
    source.write_text("{not json\n")
    with pytest.raises(ChatFormatError, match=r"bad\.jsonl:1: not JSON"):
        generate_cli.run(config(f"ckpt_path={path}", "chat=true", f"chat_input={source}"))


@pytest.mark.parametrize(("args", "message"), [
    (["chat_input=x.jsonl"], "chat_input is for chat mode: add chat=true"),
    (["chat=true", "prompt=hi"], "prompt= is not read in chat mode"),
    (["chat=true", "chat_output=o.jsonl"], "chat_output= writes the replies to chat_input"),
    (["chat=true", "num_samples=2"], "num_samples=2: chat replies once per turn"),
    (["chat=true", "chat_template=mine"], "chat_template='mine' must be one of default"),
])
def test_chat_options_are_checked_first(args, message):
    with pytest.raises(ValueError, match=message):
        generate_cli.run(config("ckpt_path=missing.ckpt", *args))


def test_interactive_chat_through_stdin(chat_ckpt, tmp_path):
    path, model, tokenizer, template = chat_ckpt
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "generate.py"), f"ckpt_path={path}", "chat=true",
           "temperature=0", "max_new_tokens=10", "dtype=float32"]
    stdin = "what is 2+3?\nand 4+4?\n/reset\nwhat is 2+3?\n/exit\nnever read\n"
    done = subprocess.run(cmd, input=stdin, cwd=tmp_path, capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    first = oracle(model, tokenizer, template, [{"role": "user", "content": "what is 2+3?"}])
    second = oracle(model, tokenizer, template, [
        {"role": "user", "content": "what is 2+3?"}, {"role": "assistant", "content": first},
        {"role": "user", "content": "and 4+4?"}])
    assert done.stdout == f"{first}\n{second}\n{first}\n"
    assert "/reset starts a new conversation" in done.stderr
    assert "(new conversation)" in done.stderr
    # end of input (Ctrl-D) ends the chat cleanly
    eof = subprocess.run(cmd, input="hello\n", cwd=tmp_path, capture_output=True, text=True,
                         env=env, timeout=120)
    assert eof.returncode == 0, eof.stderr
    assert eof.stdout == oracle(model, tokenizer, template,
                                [{"role": "user", "content": "hello"}]) + "\n"
    assert list(tmp_path.iterdir()) == [path]  # no outputs/, .hydra/ or log files


def test_terminal_says_when_the_context_is_full():
    from minigpt.chat.cli import chat_in_terminal
    from minigpt.chat.session import ChatSession

    tokenizer = char_tokenizer()
    session = ChatSession(tiny_chat_model(context_length=40), tokenizer,
                          chat_template(tokenizer), max_new_tokens=30)
    out, err = io.StringIO(), io.StringIO()
    turns = chat_in_terminal(session, ["what is 2+3?\n", "more\n", "/reset\n", "hi\n"], out, err)
    notes = err.getvalue()
    assert turns == 2
    assert "(context full: the reply was cut; type /reset" in notes
    assert "context full: the conversation holds 40 of the model's 40 tokens" in notes
    again = ChatSession(session.model, tokenizer, session.template, max_new_tokens=30)
    first = again.say("what is 2+3?").text
    again.reset()
    assert out.getvalue() == f"{first}\n{again.say('hi').text}\n"  # nothing for "more"


def test_file_mode_reads_the_instruction_form(chat_ckpt, tmp_path):
    path, model, tokenizer, template = chat_ckpt
    source = tmp_path / "book.jsonl"
    source.write_text(json.dumps({"instruction": "reverse", "input": "abc", "output": "cba"})
                      + "\n" + json.dumps({"instruction": "hi"}) + "\n")
    with pytest.raises(ChatFormatError, match=r"book\.jsonl:2: field 'output' is missing"):
        generate_cli.run(config(f"ckpt_path={path}", "chat=true", f"chat_input={source}"))
    source.write_text(source.read_text().splitlines()[0] + "\n")
    out = tmp_path / "replies.jsonl"
    generate_cli.run(config(f"ckpt_path={path}", "chat=true", f"chat_input={source}",
                            f"chat_output={out}", "temperature=0", "max_new_tokens=10"))
    record = json.loads(out.read_text())
    assert record == {"reply": oracle(model, tokenizer, template, [
        {"role": "user", "content": "reverse\n\nabc"}]), "reference": "cba"}
