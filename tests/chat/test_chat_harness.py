"""The lm-eval model with a chat template: ``apply_chat_template`` renders the template's text,
``tok_encode`` reads it back to the template's ids, a local multiple-choice task scored with
``apply_chat_template=True`` equals a plain forward pass over the rendered conversation, and
generations stop at the template's end token as the uncached oracle does."""

import json

import pytest
import torch
import torch.nn.functional as F
from chat_helpers import reread_reply

from minigpt.chat.template import ChatTemplate
from minigpt.model import GPT, GPTConfig
from minigpt.tokenizer import get_tokenizer

pytest.importorskip("lm_eval")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from minigpt.eval.harness import MiniGPTLM  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TASK = """task: minigpt_chat_mc
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {data}
validation_split: validation
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{label}}}}"
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
"""
ITEMS = [("What is 2+3?", ["5", "6", "23"], 0), ("Reverse cat.", ["tac", "cat", "act"], 0),
         ("Is ice cold?", ["yes", "no"], 0)]


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    tokenizer = get_tokenizer("gpt2")  # specials 50257..50260, inside the 50304-row model
    model = GPT(GPTConfig(vocab_size=50304, context_length=64, n_layer=2, n_head=2, n_embd=32,
                          init_std=0.5)).eval()
    return MiniGPTLM(model, tokenizer, batch_size=4,
                     chat_template=ChatTemplate.for_tokenizer(tokenizer))


def test_chat_hooks_render_and_read_back_the_template(lm):
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"}]
    text = lm.apply_chat_template(history)
    assert text == ("<|endoftext|><|system|>Be brief.<|end|><|user|>Hi<|end|><|assistant|>Hello"
                    "<|end|><|user|>2+2?<|end|><|assistant|>")
    assert lm.tok_encode(text) == lm.template.prompt_ids(history)
    prefilled = lm.apply_chat_template(history[:3], add_generation_prompt=False)
    assert prefilled.endswith("<|end|><|assistant|>Hello")
    assert lm.tokenizer_name == "minigpt-gpt2-minigpt-chat-1"
    assert json.loads(lm.chat_template(True)) == lm.template.to_dict()


def test_multiple_choice_with_the_chat_template(lm, tmp_path):
    (tmp_path / "items.json").write_text("".join(
        json.dumps({"question": q, "choices": c, "label": a}) + "\n" for q, c, a in ITEMS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "mc.yaml").write_text(TASK.format(data=tmp_path / "items.json"))
    manager = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    result = simple_evaluate(model=lm, tasks=["minigpt_chat_mc"], task_manager=manager,
                             log_samples=True, apply_chat_template=True)
    samples = result["samples"]["minigpt_chat_mc"]
    template, tokenizer = lm.template, lm.tokenizer_
    for sample in sorted(samples, key=lambda s: s["doc_id"]):
        question, choices, _ = ITEMS[sample["doc_id"]]
        for args, resp in zip(sample["arguments"], sample["resps"], strict=True):
            context, continuation = args
            assert context == f"<|endoftext|><|user|>{question}<|end|><|assistant|>"
            ids = template.prompt_ids([{"role": "user", "content": question}])
            target = tokenizer.encode(continuation)
            with torch.no_grad():
                logprobs = F.log_softmax(lm.model(torch.tensor([ids + target]))[0].float(), -1)
            expected = sum(float(logprobs[len(ids) - 1 + i, t]) for i, t in enumerate(target))
            assert float(resp[0][0]) == pytest.approx(expected, abs=1e-4)
    assert result["results"]["minigpt_chat_mc"]["acc,none"] is not None


def test_generation_stops_at_the_end_token(lm):
    template, weight = lm.template, lm.model.lm_head.weight  # tied: also the embedding
    context = lm.apply_chat_template([{"role": "user", "content": "Say something."}])
    prompt = lm.tok_encode(context)
    free = reread_reply(lm.model, prompt, template.end_id, lm.tokenizer_.eot_id, 20)
    saved = weight[template.end_id].clone()
    with torch.no_grad():  # the end token outscores the reply's third token: a stop to test
        weight[template.end_id] = 10 * weight[free[2]]
    try:
        request = Instance(request_type="generate_until", doc={}, idx=0,
                           arguments=(context, {"until": ["\n\n"], "max_gen_toks": 20}))
        (text,) = lm.generate_until([request])
        ids = reread_reply(lm.model, prompt, template.end_id, lm.tokenizer_.eot_id, 20)
        assert len(ids) < 20  # it stopped at the end token
        assert text == lm.tokenizer_.decode(ids).split("\n\n")[0]
    finally:
        with torch.no_grad():
            weight[template.end_id] = saved
