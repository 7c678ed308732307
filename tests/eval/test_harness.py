"""The lm-eval model against lm-eval's own HFLM on the same exported weights: equal
log-likelihoods (within 1e-4), equal accuracy on a local task, equal greedy generations. With a
chat template: its text read back to its ids, a local task under ``apply_chat_template=True``
against a plain forward pass over the rendered conversation, generations stopping at ``<|end|>``
as the uncached greedy oracle does."""

from __future__ import annotations

import importlib
import json
import sys

import pytest
import torch
import torch.nn.functional as F
from chat_helpers import reread_reply
from eval_helpers import eval_config, gpt2_tokenizer, hf_model, tiny_model, write_items

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from minigpt.chat.template import ChatTemplate  # noqa: E402
from minigpt.errors import UserError  # noqa: E402
from minigpt.eval.harness import MiniGPTLM, run_harness  # noqa: E402
from minigpt.eval.run import run  # noqa: E402
from minigpt.model import GPT, GPTConfig  # noqa: E402
from minigpt.tokenizer import get_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {data}
validation_split: validation
output_type: multiple_choice
doc_to_text: "{{{{{text}}}}}"
doc_to_target: "{{{{label}}}}"
doc_to_choice: "{{{{{choices}}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(ours, HFLM) on one tiny model of context 16, so that long requests are cut and rolling
    log-likelihoods take several windows."""
    directory = tmp_path_factory.mktemp("harness")
    model = tiny_model(context_length=16)
    hf = hf_model(model, directory / "hf")
    ours = MiniGPTLM(model, get_tokenizer("gpt2"), batch_size=5)
    theirs = HFLM(pretrained=hf, tokenizer=gpt2_tokenizer(), batch_size=3, device="cpu")
    return ours, theirs, directory


def _task_dir(directory):
    records = write_items(directory / "items.jsonl")
    lines = [json.dumps({"ctx": r.get("ctx") or f"{r['ctx_a']} {r['ctx_b']}",
                         "endings": r["endings"], "label": int(r["label"])}) for r in records]
    (directory / "items.json").write_text("\n".join(lines) + "\n")
    tasks = directory / "tasks"
    tasks.mkdir(exist_ok=True)
    (tasks / "tiny.yaml").write_text(TASK.format(name="minigpt_tiny_mc", text="ctx",
                                                 choices="endings", data=directory / "items.json"))
    return tasks


def test_local_task_matches_hflm(pair):
    ours, theirs, directory = pair
    manager = TaskManager(include_path=str(_task_dir(directory)), include_defaults=False)
    runs = [simple_evaluate(model=lm, tasks=["minigpt_tiny_mc"], task_manager=manager,
                            log_samples=True) for lm in (ours, theirs)]
    (a, b) = [[float(resp[0][0]) for s in r["samples"]["minigpt_tiny_mc"] for resp in s["resps"]]
              for r in runs]
    assert len(a) == 4 * 12
    assert a == pytest.approx(b, abs=1e-4)
    metrics = [{k: v for k, v in r["results"]["minigpt_tiny_mc"].items()
                if k in ("acc,none", "acc_norm,none")} for r in runs]
    assert metrics[0] == metrics[1] and len(metrics[0]) == 2
    again = run_harness(ours, ["minigpt_tiny_mc"], task_manager=manager, limit=4)
    assert again["results"]["minigpt_tiny_mc"]["acc,none"] is not None
    with pytest.raises(UserError, match="lm_eval knows no task 'no_such_task'"):
        run_harness(ours, ["no_such_task"], task_manager=manager)


def _requests(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_loglikelihood_edge_cases_match_hflm(pair):
    ours, theirs, _ = pair
    args = [("", "Hello world"), ("The cat sat on the ", "mat."),
            ("A very long context " * 8, " that is cut from the left"),
            ("Short", " but the continuation alone runs longer than sixteen tokens, many more")]
    a, b = (lm.loglikelihood(_requests("loglikelihood", args)) for lm in (ours, theirs))
    assert [x for x, _ in a] == pytest.approx([x for x, _ in b], abs=1e-4)
    assert [g for _, g in a] == [g for _, g in b]


def test_loglikelihood_rolling_matches_hflm(pair):
    ours, theirs, _ = pair
    texts = [("One short line.",), ("A longer text that needs several windows of sixteen "
                                    "tokens to be scored, every token exactly once. " * 3,)]
    a, b = (lm.loglikelihood_rolling(_requests("loglikelihood_rolling", texts))
            for lm in (ours, theirs))
    assert a == pytest.approx(b, abs=1e-4)


def test_generate_until_matches_hflm_greedy(pair):
    ours, theirs, _ = pair
    args = [("The weather today is", {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}),
            ("Once upon a time", {"until": ["the"], "max_gen_toks": 8})]
    a = ours.generate_until(_requests("generate_until", args))
    b = theirs.generate_until(_requests("generate_until", args))
    assert a == b and len(a) == 2 and any(a)


def test_command_runs_a_local_task(pair, tmp_path, capsys):
    _, _, directory = pair
    tasks = _task_dir(directory)
    out = tmp_path / "harness.json"
    result = run(eval_config("task=harness", "tasks=[minigpt_tiny_mc]", f"include_path={tasks}",
                             f"pretrained={directory / 'hf'}", "limit=4", f"out={out}"))
    assert "minigpt_tiny_mc" in capsys.readouterr().out  # lm-eval's table
    written = json.loads(out.read_text())
    assert written["results"]["minigpt_tiny_mc"]["acc,none"] == \
        result["results"]["minigpt_tiny_mc"]["acc,none"]


def test_missing_lm_eval_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval.api.model", None)
    monkeypatch.delitem(sys.modules, "minigpt.eval.harness")
    with pytest.raises(UserError, match=r"not installed.*pip install -e '\.\[eval\]'"):
        importlib.import_module("minigpt.eval.harness")


def test_lm_evals_own_models_still_resolve_after_ours_is_registered():
    """lm-eval fills its registry with its built-in models only when the registry is empty; a
    fresh process that imports our harness first must still find ``hf`` and
    ``local-completions`` (``simple_evaluate(model="hf")``)."""
    import subprocess

    code = ("import minigpt.eval.harness\n"
            "from lm_eval.api.registry import get_model\n"
            "print(get_model('hf').__name__, get_model('local-completions').__name__, "
            "get_model('minigpt').__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["HFLM", "LocalCompletionsAPI", "MiniGPTLM"]


# ---- with a chat template (a model fine-tuned with experiment=sft) --------------------------

ITEMS = [("What is 2+3?", ["5", "6", "23"], 0), ("Reverse cat.", ["tac", "cat", "act"], 0),
         ("Is ice cold?", ["yes", "no"], 0)]


@pytest.fixture(scope="module")
def chat_lm():
    torch.manual_seed(0)
    tokenizer = get_tokenizer("gpt2")  # specials 50257..50260, inside the 50304-row model
    model = GPT(GPTConfig(vocab_size=50304, context_length=64, n_layer=2, n_head=2, n_embd=32,
                          init_std=0.5)).eval()
    return MiniGPTLM(model, tokenizer, batch_size=4,
                     chat_template=ChatTemplate.for_tokenizer(tokenizer))


def test_chat_hooks_render_and_read_back_the_template(chat_lm):
    lm = chat_lm
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


def test_multiple_choice_with_the_chat_template(chat_lm, tmp_path):
    lm = chat_lm
    (tmp_path / "items.json").write_text("".join(
        json.dumps({"question": q, "choices": c, "label": a}) + "\n" for q, c, a in ITEMS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "mc.yaml").write_text(TASK.format(
        name="minigpt_chat_mc", text="question", choices="choices", data=tmp_path / "items.json"))
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


def test_generation_stops_at_the_end_token(chat_lm):
    lm = chat_lm
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
