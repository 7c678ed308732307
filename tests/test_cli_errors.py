"""Bad input through the real command lines: exit status 2, one line on stderr naming the bad
value, nothing written that looks complete, and no time lost on heavy work first."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The fixture's model, so a resume of it gets past the model check.
FIXTURE_MODEL = ["model.n_layer=1", "model.n_head=2", "model.n_embd=8", "model.context_length=16"]
QUIET = ["logger=none", "trainer.enable_progress_bar=false"]


def cli(tmp: Path, program: str, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "minigpt.data"] if program == "prepare" else \
        [sys.executable, str(ROOT / program)]
    start = time.perf_counter()
    result = subprocess.run([*command, *args], cwd=tmp, env=env, capture_output=True, text=True,
                            timeout=300)
    return result, time.perf_counter() - start


def cases(tmp: Path, checkpoint: Path) -> list[tuple[str, str, list[str], str]]:
    """(case, program, arguments, text the one line must contain); ``checkpoint`` is the
    fixture's 3-step run."""
    truncated = tmp / "truncated.ckpt"
    truncated.write_bytes(checkpoint.read_bytes()[:20_000])
    (tmp / "corpus").mkdir()
    (tmp / "corpus" / "good.txt").write_text("plain text " * 20)
    for name in ("bad1.txt", "bad2.txt"):
        (tmp / "corpus" / name).write_bytes(b"\xff\xfe\x00 not utf-8 \xc3\x28" * 20)
    data = f"data_root={tmp / 'data'}"
    return [
        ("huge context", "train.py", ["model.context_length=100000", data, *QUIET],
         "model.context_length=100000"),
        ("huge batch", "train.py", ["data.batch_size=100000", data, *QUIET],
         "data.batch_size=100000"),
        ("truncated checkpoint", "train.py", [f"ckpt_path={truncated}", data, *QUIET],
         "truncated.ckpt is not a readable checkpoint"),
        ("other model", "train.py",
         [f"ckpt_path={checkpoint}", *FIXTURE_MODEL, "model.n_layer=2", data, *QUIET],
         "model.n_layer=2 here, 1 in the checkpoint"),
        ("past the end", "train.py",
         [f"ckpt_path={checkpoint}", *FIXTURE_MODEL, "trainer.max_steps=2", data, *QUIET],
         "is at step 3; trainer.max_steps=2: raise trainer.max_steps above 3"),
        ("truncated checkpoint to sample", "generate.py", [f"ckpt_path={truncated}"],
         "truncated.ckpt is not a readable checkpoint"),
        ("undecodable files", "prepare",
         ["data=local_files", f"data.paths=[{tmp / 'corpus'}/*.txt]", data],
         "2 of 3 files (" + f"{tmp / 'corpus' / 'bad1.txt'}, {tmp / 'corpus' / 'bad2.txt'}"),
    ]


def test_bad_inputs_are_one_line_and_exit_2(tmp_path, checkpoint_v1):
    table = cases(tmp_path, checkpoint_v1)
    with ThreadPoolExecutor(max_workers=2) as pool:  # each is mostly interpreter start-up
        results = list(pool.map(lambda c: cli(tmp_path, c[1], *c[2]), table))
    for (case, _, _, expected), (result, seconds) in zip(table, results, strict=True):
        # What preparation says it is reading is not part of the error.
        lines = [line for line in result.stderr.strip().splitlines()
                 if not line.startswith("reading paths")]
        assert result.returncode == 2, (case, result.stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: "), (case, lines)
        assert expected in lines[0], (case, lines[0])
        assert seconds < 60, (case, seconds)
    # Nothing that looks complete: no checkpoint, no summary, no prepared local_files data.
    for pattern in ("*.ckpt", "summary.json"):
        written = [p for p in (tmp_path / "outputs").rglob(pattern)] \
            if (tmp_path / "outputs").exists() else []
        assert written == [], written
    assert not (tmp_path / "data" / "local_files" / "meta.json").exists()


@pytest.mark.parametrize("edit, message", [
    ({"vocab_size": 50}, "vocab_size=50 but its 'char' tokenizer has"),
    ({"dtype": "float64"}, "dtype='float64'"),
    ({"train_tokens": "many"}, "train_tokens='many' must be an integer"),
    ({"tokenizer": {"type": "magic"}}, "is not a minigpt tokenizer record"),
    ({"max_token_id": 10**6}, "max_token_id=1000000 is outside"),
])
def test_an_edited_meta_json_is_one_line_naming_the_file_and_the_fix(tmp_path, edit, message):
    import json

    from minigpt.data import DataError, load_meta, prepare_dataset

    cfg = {"name": "tiny", "source": "files", "paths": [str(tmp_path / "a.txt")],
           "tokenizer": "char", "val_fraction": 0.5}
    (tmp_path / "a.txt").write_text("some text to prepare " * 10)
    prepare_dataset(cfg, tmp_path / "data", progress=False)
    meta_path = tmp_path / "data" / "tiny" / "meta.json"
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), **edit}))
    with pytest.raises(DataError) as error:
        load_meta(meta_path.parent)
    text = str(error.value)
    assert "\n" not in text and str(meta_path) in text and message in text
    assert f"delete {meta_path.parent} and prepare it again" in text


def test_a_rebuild_says_why_on_the_console(tmp_path, capfd):
    import json

    from minigpt.data import prepare_dataset

    cfg = {"name": "tiny", "source": "files", "paths": [str(tmp_path / "a.txt")],
           "tokenizer": "char", "val_fraction": 0.5}
    (tmp_path / "a.txt").write_text("some text to prepare " * 10)
    meta = prepare_dataset(cfg, tmp_path / "data", progress=False)
    meta_path = tmp_path / "data" / "tiny" / "meta.json"
    meta_path.write_text(json.dumps({**meta, "vocab_size": 3}))
    capfd.readouterr()
    assert prepare_dataset(cfg, tmp_path / "data", progress=False)["vocab_size"] == \
        meta["vocab_size"]
    err = capfd.readouterr().err
    assert f"preparing {meta_path.parent} again: {meta_path}: vocab_size=3" in err
