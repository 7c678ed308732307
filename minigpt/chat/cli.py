"""What ``python generate.py chat=true`` runs: a conversation in the terminal, or the replies to
each conversation of a ``.jsonl`` file (``chat_input=``), scored by exact match.

Replies go to ``out`` (stdout); the prompt, notices and scores to ``err`` (stderr).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from minigpt.chat.session import ChatSession, ContextFullError
from minigpt.chat.template import (
    ChatFormatError,
    ChatTemplate,
    check_conversation,
    check_message,
)
from minigpt.data.chat import conversation_of
from minigpt.errors import UserError
from minigpt.files import atomic_write, read_jsonl

COMMANDS = "/reset starts a new conversation, /exit (or Ctrl-D) ends"
RECORD = ('a conversation is one JSON object per line: {"messages": [{"role": ..., "content": '
          '...}]} or {"instruction": ..., "input": ..., "output": ...}')


def run_chat(cfg, out=None, lines: Iterable[str] | None = None) -> dict | None:
    """``generate.py chat=true``: load the model ``cfg`` (a ``GenerateSchema``) names with its
    chat template, then talk in the terminal (``lines``: stdin) or answer ``cfg.chat_input``.
    Returns ``answer_conversations``' result in the file mode."""
    from minigpt.inference import load_for_inference

    out, err = out or sys.stdout, sys.stderr
    conversations = None if cfg.chat_input is None else \
        [record["messages"] for record in read_records(cfg.chat_input)]
    loaded = load_for_inference(cfg.ckpt_path, cfg.pretrained, cfg.checkpoints_root,
                                device=cfg.device, dtype=cfg.dtype)
    template = chat_template_of(loaded, cfg.chat_template)
    applied = loaded.place(cpu_speedups=cfg.cpu_speedups is not False)
    _note(err, f"{loaded.describe()}; cpu speedups: {', '.join(applied) or 'none'}; replies "
               f"of up to {cfg.max_new_tokens} tokens")
    generator = torch.Generator(device=loaded.device).manual_seed(cfg.seed)
    session = ChatSession(loaded.model, loaded.tokenizer, template,
                          max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                          top_k=cfg.top_k, top_p=cfg.top_p, generator=generator)
    if conversations is None:
        chat_in_terminal(session, lines, out, err)
        return None
    if cfg.temperature > 0:
        _note(err, f"sampling at temperature={cfg.temperature}; exact match is usually scored "
                   "greedy: temperature=0")
    result = answer_conversations(session, conversations, cfg.chat_output, err)
    if cfg.chat_output is not None:
        _note(err, f"wrote {result['n']} replies to {cfg.chat_output}")
    return result


def chat_template_of(loaded, choice: str | None) -> ChatTemplate:
    """The template a loaded model chats with: its checkpoint's, or (``choice="default"``) the
    untrained one of its tokenizer; one line naming the fix when there is none or the model has
    no rows for its special tokens."""
    if choice == "default":
        template = ChatTemplate.for_tokenizer(loaded.tokenizer)
    elif loaded.chat_template is None:
        raise UserError(f"{loaded.source} has no chat template: it is a base model, not "
                        "fine-tuned for chat. Fine-tune it with `python train.py experiment=sft "
                        f"model.init_from={loaded.source}` (docs/chat.md), or give "
                        "chat_template=default to try the untrained template")
    else:
        template = loaded.chat_template
    rows = loaded.model.config.vocab_size
    if template.min_vocab_size > rows:
        raise UserError(f"the chat template's special tokens need {template.min_vocab_size} "
                        f"embedding rows but {loaded.source} has {rows}; fine-tune it with "
                        "experiment=sft, which adds them (docs/chat.md)")
    return template


def read_records(path, limit: int | None = None,
                 check: Callable[[dict], None] | None = None) -> list[dict]:
    """The first ``limit`` JSON objects (all with None) of a ``.jsonl`` file of conversations,
    each with a checked ``messages`` list (other fields as they are, ``check``ed if given: it
    raises ``ChatFormatError``); a bad line is one ``ChatFormatError`` naming file, line, field."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"conversation file {path} not found; {RECORD}")
    records = read_jsonl(path, lambda record, where: _checked_record(record, where, check),
                         lambda message: ChatFormatError(f"{message}; {RECORD}"), limit)
    if not records:
        raise ChatFormatError(f"{path} holds no conversation; {RECORD}")
    return records


def _checked_record(record: dict, where: str, check) -> dict:
    try:
        record = {**record, "messages": conversation_of(record)}  # the instruction form too
    except ValueError as e:
        raise ChatFormatError(f"{where}: {e}; {RECORD}") from None
    try:
        check_conversation(record["messages"])
        for i, message in enumerate(record["messages"]):
            check_message(message, i)
        if check is not None:
            check(record)
    except ChatFormatError as e:
        raise ChatFormatError(f"{where}: {e}") from None
    return record


def chat_in_terminal(session: ChatSession, lines: Iterable[str] | None = None, out=None,
                     err=None) -> int:
    """Talk with the user: each line of ``lines`` (stdin) is a user turn, its reply streamed to
    ``out``; ``/reset`` and ``/exit`` as ``COMMANDS`` says. Returns the turns answered."""
    lines = iter(sys.stdin if lines is None else lines)
    out, err = out or sys.stdout, err or sys.stderr
    turns = 0
    _note(err, f"chat: {COMMANDS}")
    while True:
        err.write("> ")
        err.flush()
        line = next(lines, None)
        if line is None:  # end of input (Ctrl-D)
            err.write("\n")
            break
        text = line.rstrip("\r\n")
        command = text.strip()
        if command == "/exit":
            break
        if command == "/reset":
            session.reset()
            _note(err, "(new conversation)")
            continue
        if not command:
            continue
        try:
            reply = session.say(text, on_text=lambda t: _write(out, t))
        except ContextFullError as e:
            _note(err, str(e))
            continue
        _write(out, "\n")
        turns += 1
        if reply.stopped == "context":
            _note(err, "(context full: the reply was cut; type /reset to start a new "
                       "conversation)")
    return turns


def answer_conversations(session: ChatSession, conversations: Sequence[Sequence[dict]],
                         output=None, err=None) -> dict:
    """Reply to each conversation (its last assistant message, if any, is the reference and is
    not shown to the model); write ``{"reply", "reference"}`` per line to ``output`` (a path)
    and print the exact-match accuracy over the conversations with a reference to ``err``.
    Returns ``{"n", "with_reference", "exact_match", "records"}`` (``exact_match``: None
    without references)."""
    err = err or sys.stderr
    records = []
    for messages in conversations:
        prompt, reference = split_reference(messages)
        reply = session.answer(prompt)
        records.append({"reply": reply.text, "reference": reference})
    if output is not None:
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        atomic_write(Path(output), lambda tmp: tmp.write_text(text, encoding="utf-8"))
    scored = [exact_match(r["reply"], r["reference"]) for r in records
              if r["reference"] is not None]
    accuracy = sum(scored) / len(scored) if scored else None
    if accuracy is not None:
        _note(err, f"exact match: {sum(scored)}/{len(scored)} = {accuracy:.4f}")
    return {"n": len(records), "with_reference": len(scored), "exact_match": accuracy,
            "records": records}


def split_reference(messages: Sequence[dict]) -> tuple[list[dict], str | None]:
    """``(messages the model reads, the reference reply or None)``: a conversation that ends
    with an assistant message has that message as its reference."""
    messages = list(messages)
    if messages and messages[-1]["role"] == "assistant":
        return messages[:-1], messages[-1]["content"]
    return messages, None


def exact_match(reply: str, reference: str) -> bool:
    """The reply is the reference, leading and trailing whitespace aside."""
    return reply.strip() == reference.strip()


def _write(out, text: str) -> None:
    if text:
        out.write(text)
        out.flush()


def _note(err, message: str) -> None:
    print(message, file=err, flush=True)
