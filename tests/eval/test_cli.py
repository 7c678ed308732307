"""``python -m minigpt.eval``: composed with Hydra's compose API and run in-process, plus one
subprocess run for the real command line and its one-line errors."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch
from eval_helpers import ROOT, tiny_model, write_items
from eval_helpers import eval_config as config

from minigpt.checkpoint import checkpoint_metadata
from minigpt.errors import UserError
from minigpt.eval import read_items, score_items
from minigpt.eval.__main__ import harness_arguments
from minigpt.eval.run import run
from minigpt.tokenizer import get_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    """One tiny model as a Hugging Face directory and as a training checkpoint, and an item
    file."""
    directory = tmp_path_factory.mktemp("cli")
    model, tokenizer = tiny_model(context_length=32), get_tokenizer("gpt2")
    model.save_pretrained(str(directory / "hf"))
    torch.save({"minigpt": checkpoint_metadata(model.config.to_dict(), tokenizer.to_dict()),
                "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}},
               directory / "last.ckpt")
    write_items(directory / "hs.jsonl")
    return directory, model


def test_pretrained_and_checkpoint_write_the_same_result(model_files, tmp_path):
    directory, model = model_files
    expected = score_items(model, get_tokenizer("gpt2"), read_items(directory / "hs.jsonl"))
    results = []
    for source in (f"pretrained={directory / 'hf'}", f"ckpt_path={directory / 'last.ckpt'}"):
        shown = io.StringIO()
        out = tmp_path / f"result{len(results)}.json"
        run(config(source, f"path={directory / 'hs.jsonl'}", f"out={out}", "batch_size=5"),
            out=shown)
        written = json.loads(out.read_text())
        assert {k: written[k] for k in ("acc", "acc_norm", "n", "choices")} == {
            "acc": expected.acc, "acc_norm": expected.acc_norm, "n": 12,
            "choices": expected.choices}
        assert shown.getvalue().splitlines()[1].split()[:2] == ["hellaswag", "12"]
        results.append(written)
    assert results[0]["truncated"] == results[1]["truncated"]


def test_limit_and_options_checked_before_loading(model_files):
    directory, _ = model_files
    result = run(config(f"pretrained={directory / 'hf'}", f"path={directory / 'hs.jsonl'}",
                        "limit=3"), out=io.StringIO())
    assert result["n"] == 3 and len(result["choices"]) == 3
    with pytest.raises(UserError, match=r"task='mmlu' must be one of.*batch_size=0 must be"):
        run(config("task=mmlu", "batch_size=0"))
    with pytest.raises(UserError, match="tasks= is for the harness"):
        run(config("tasks=[arc_easy]"))
    with pytest.raises(UserError, match="harness needs tasks: python -m minigpt.eval harness"):
        run(config("task=harness", "ckpt_path=/no/such.ckpt"))  # before the model is read


def test_harness_arguments():
    assert harness_arguments(["harness", "tasks=a,b", "limit=2"]) == [
        "task=harness", "tasks=[a,b]", "limit=2"]
    assert harness_arguments(["tasks=[a,b]", "path=x,y.jsonl"]) == ["tasks=[a,b]",
                                                                    "path=x,y.jsonl"]


def test_command_line_errors_in_one_line(model_files, tmp_path):
    directory, _ = model_files
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ctx": "a", "endings": ["b", "c"], "label": 0}\n')
    cmd = [sys.executable, "-m", "minigpt.eval", f"pretrained={directory / 'hf'}",
           f"path={bad}"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"error: {bad}:1: 'endings' has 2 entries, a HellaSwag item has exactly 4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no outputs/, logs


def test_command_line_errors_exit_codes(capsys):
    from minigpt.errors import command_line_errors

    with pytest.raises(SystemExit) as stopped, command_line_errors(ValueError):
        raise ValueError("bad\nvalue")
    assert stopped.value.code == 2 and capsys.readouterr().err == "error: bad value\n"
    with pytest.raises(SystemExit) as stopped, command_line_errors():
        raise KeyboardInterrupt
    assert stopped.value.code == 130
    with pytest.raises(RuntimeError), command_line_errors(ValueError):  # a bug keeps its traceback
        raise RuntimeError("bug")
