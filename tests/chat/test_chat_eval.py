"""``python -m minigpt.eval task=chat``: exact match against the greedy reply of re-reading the
conversation, multiple choice against each choice's log-likelihood computed by a plain forward
pass, and the metrics a training run logs."""

import io
import json

import pytest
import torch
import torch.nn.functional as F
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
from minigpt.config import EvalSchema
from minigpt.errors import UserError
from minigpt.eval.chat import ChatTask
from minigpt.eval.run import run
from minigpt.eval.training import tasks_in_training, training_items

pytestmark = pytest.mark.usefixtures("one_thread")
QUESTIONS = ["what is 2+3?", "reverse abc", "hello", "say yes.", "count to 3"]
CHOICES = ["yes", "no", "maybe so"]


def user(text):
    return [{"role": "user", "content": text}]


def choice_logprob(model, template, tokenizer, messages, choice):
    """The oracle: one uncached forward pass over the prompt and the choice as the reply."""
    context = template.prompt_ids(messages)
    reply = tokenizer.encode(choice) + [template.end_id]
    logits = model(torch.tensor([context + reply]))[0]  # (T, V)
    logprobs = F.log_softmax(logits.float(), dim=-1)
    return sum(float(logprobs[len(context) - 1 + i, t]) for i, t in enumerate(reply))


@pytest.fixture
def chat_items(tmp_path):
    """A chat checkpoint and a file of 5 exact-match items (2 right) and 4 multiple-choice
    items (3 right); returns the paths and the expected metrics."""
    tokenizer, model = char_tokenizer(), tiny_chat_model(context_length=160)
    template = chat_template(tokenizer)
    ckpt = save_chat_checkpoint(tmp_path / "chat.ckpt", model, tokenizer, template)
    records = []
    with torch.no_grad():
        for i, q in enumerate(QUESTIONS):
            said = tokenizer.decode(reread_reply(model, template.prompt_ids(user(q)),
                                                 template.end_id, tokenizer.eot_id, 40))
            reference = said + " " if i < 2 else said + "x"
            records.append({"messages": user(q) + [{"role": "assistant", "content": reference}]})
        for i, q in enumerate(QUESTIONS[:4]):
            scores = [choice_logprob(model, template, tokenizer, user(q), c) for c in CHOICES]
            best = max(range(3), key=scores.__getitem__)
            records.append({"messages": user(q), "choices": CHOICES,
                            "answer": best if i < 3 else (best + 1) % 3})
    path = tmp_path / "val.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return ckpt, path, model, template


def config(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("eval", overrides=["progress=false", "dtype=float32", *overrides])


def test_chat_task_scores_exact_match_and_multiple_choice(chat_items, tmp_path):
    ckpt, path, _, _ = chat_items
    shown, out = io.StringIO(), tmp_path / "result.json"
    result = run(config("task=chat", f"ckpt_path={ckpt}", f"path={path}", f"out={out}",
                        "batch_size=2"), out=shown)
    assert result["exact_match"] == pytest.approx(2 / 5)
    assert result["mc_acc"] == pytest.approx(3 / 4)
    assert result["n"] == 9 and result["truncated"] == 0
    answers = json.loads(out.read_text())["answers"]  # replies, then choices
    expected = [json.loads(line)["answer"] for line in path.read_text().splitlines()[5:]]
    assert answers[5:8] == expected[:3] and answers[8] != expected[3]
    assert isinstance(answers[0], str)
    assert shown.getvalue().splitlines()[1].split()[:4] == ["chat", "9", "0.4000", "0.7500"]


def test_a_file_of_one_kind_leaves_the_other_metric_out(chat_items, tmp_path):
    ckpt, path, model, template = chat_items
    exact_only = tmp_path / "exact.jsonl"
    exact_only.write_text("".join(path.read_text().splitlines(keepends=True)[:5]))
    shown = io.StringIO()
    result = run(config("task=chat", f"ckpt_path={ckpt}", f"path={exact_only}"), out=shown)
    assert result["exact_match"] == pytest.approx(2 / 5) and result["mc_acc"] is None
    assert shown.getvalue().splitlines()[1].split()[:4] == ["chat", "5", "0.4000", "-"]
    # what a training run logs: eval/chat/<metric>, only the metrics measured; the run hands
    # the task its template
    settings = EvalSchema(tasks=["chat"], every=1, limit=None, path=str(exact_only))
    tasks = training_items(settings, tmp_path, template)
    assert tasks[0][0].chat_template is template
    with pytest.raises(UserError, match="'chat', which scores conversations .*experiment=sft"):
        training_items(settings, tmp_path, None)  # a pretraining run has no template
    logged = tasks_in_training(model, template.tokenizer, tasks, "cpu")
    assert logged == {"eval/chat/exact_match": pytest.approx(2 / 5)}


def test_a_base_model_needs_the_default_template(chat_items, tmp_path):
    _, path, model, template = chat_items
    base = save_chat_checkpoint(tmp_path / "base.ckpt", model, template.tokenizer)
    with pytest.raises(UserError, match="has no chat template: .*experiment=sft"):
        run(config("task=chat", f"ckpt_path={base}", f"path={path}"))
    result = run(config("task=chat", f"ckpt_path={base}", f"path={path}",
                        "chat_template=default"), out=io.StringIO())
    assert result["exact_match"] == pytest.approx(2 / 5)  # the same template, untrained name


@pytest.mark.parametrize(("record", "message"), [
    ({"messages": [{"role": "user", "content": "hi"}]}, "no reference"),
    ({"messages": [{"role": "user", "content": "hi"}], "choices": ["a"], "answer": 0},
     "field 'choices' must list at least two"),
    ({"messages": [{"role": "user", "content": "hi"}], "choices": ["a", "b"], "answer": 2},
     "field 'answer'=2 must be the index"),
])
def test_bad_items_name_the_line_and_field(tmp_path, record, message):
    path = tmp_path / "bad.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ChatFormatError, match=rf"bad\.jsonl:2: {message}"):
        ChatTask(str(path)).items()
    with pytest.raises(UserError, match="task=chat needs path=FILE.jsonl"):
        ChatTask().items()


def test_apply_chat_template_is_for_the_harness(chat_items):
    ckpt, path, _, _ = chat_items
    with pytest.raises(UserError, match="apply_chat_template=true is for the harness"):
        run(config("task=chat", f"ckpt_path={ckpt}", f"path={path}", "apply_chat_template=true"))
