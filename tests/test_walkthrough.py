"""docs/walkthrough.md runs as written: every ```bash and ```python block, in order.

The blocks run in a scratch directory holding copies of the entry points and configs (so nothing
lands in the repository: outputs/, data/, PNGs), with the commands below shrunk by overrides
appended to the line. A block preceded by ``<!-- walkthrough-test: skip (reason) -->`` is not run.
"""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "walkthrough.md"
COPIED = ("train.py", "generate.py", "configs", "bench")

# Command prefix -> arguments appended to every line starting with it (later ones win in Hydra
# and argparse alike). Tiny sizes: the whole page runs in about a minute on 2 busy cores.
_TRAIN = [
    "trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
    "sample.max_new_tokens=4", "model.n_layer=2", "model.n_head=2", "model.n_embd=32",
    "model.context_length=64",  # the attention maps' default prompt is 60 characters
    "data.batch_size=4", "data.val_tokens=256",
]
SHRINK = {
    # the attention lab: two of its variants (first: the more specific prefix wins)
    "python train.py -m experiment=attention_variants": " ".join(
        [*_TRAIN, "attention=gpt2,rope_window", "threads=1"]),
    "python train.py": " ".join(_TRAIN),
    "python generate.py": "max_new_tokens=8",
    "python -m bench.attention": "--shape 8x256x384/6 --warmup 1 --repeats 1",
    "python -m bench.attention_runs": "--repeats 1 --new-tokens 4",
}

_BLOCK = re.compile(
    r"(?P<directive><!--\s*walkthrough-test:\s*(?P<what>[^>]*?)\s*-->\s*\n)?"
    r"^```(?P<lang>bash|python)\n(?P<code>.*?)^```", re.M | re.S)


def doc_blocks(text: str) -> list[tuple[str, str, bool]]:
    """(language, code, skipped) for each fenced bash/python block, in document order."""
    return [(m["lang"], m["code"], bool(m["what"]) and m["what"].startswith("skip"))
            for m in _BLOCK.finditer(text)]


def shrink(line: str) -> str:
    stripped = line.strip()
    for prefix, extra in SHRINK.items():
        if extra and (stripped == prefix or stripped.startswith(prefix + " ")):
            return f"{line.rstrip()} {extra}"
    return line


def test_doc_blocks_are_found_and_shrunk():
    blocks = doc_blocks(DOC.read_text())
    langs = [lang for lang, _, _ in blocks]
    assert "bash" in langs and "python" in langs
    assert [skip for _, _, skip in blocks].count(True) == 1  # only `pip install -e .`
    commands = [line for lang, code, skip in blocks if lang == "bash" and not skip
                for line in code.splitlines() if line.strip()]
    assert any(line.startswith("python train.py") for line in commands)
    assert any(line.startswith("python generate.py") for line in commands)
    assert any(line.startswith("python -m minigpt.viz attention") for line in commands)
    assert any(line.startswith("python -m minigpt.viz runs") for line in commands)
    assert any(line.startswith("python -m bench.attention ") for line in commands)
    assert any(line.startswith("python train.py -m experiment=attention_variants")
               for line in commands)
    assert shrink("python train.py -m experiment=attention_variants").endswith(
        "attention=gpt2,rope_window threads=1")
    assert not any(line.rstrip().endswith("\\") for line in commands)  # one command a line
    assert shrink("python train.py seed=1").endswith(SHRINK["python train.py"])


def test_pictures_the_doc_shows_exist_and_are_small():
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", DOC.read_text())
    assert images
    for image in images:
        path = DOC.parent / image
        assert path.is_file(), f"{image} is linked from the walkthrough but missing"
        assert path.stat().st_size < 300_000, f"{image} is {path.stat().st_size} bytes"


def test_walkthrough_commands_run(tmp_path, monkeypatch, capsys):
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif source.is_file():
            shutil.copy2(source, tmp_path / name)
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg",
           # `python` in the blocks is the interpreter running the tests
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.setdefault("TIKTOKEN_CACHE_DIR", str(ROOT.parent / "shared" / "tiktoken-cache"))
    monkeypatch.chdir(tmp_path)
    timings = []
    for i, (lang, code, skip) in enumerate(doc_blocks(DOC.read_text())):
        if skip:
            continue
        start = time.perf_counter()
        if lang == "python":  # in this process: no interpreter start-up, a fresh namespace
            try:
                exec(compile(code, f"walkthrough block {i}", "exec"), {"__name__": "__main__"})
            except Exception as e:
                pytest.fail(f"walkthrough block {i} (python) raised {e!r}:\n{code}")
        else:
            script = "\n".join(shrink(line) for line in code.splitlines())
            result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path,
                                    env=env, capture_output=True, text=True, timeout=300)
            if result.returncode != 0:
                pytest.fail(f"walkthrough block {i} (bash) failed with exit code "
                            f"{result.returncode}:\n{script}\n--- stdout\n"
                            f"{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}")
        timings.append(f"block {i} ({lang}): {time.perf_counter() - start:.1f} s")
    with capsys.disabled():
        print("\n" + "\n".join(timings))
    # the pictures the commands promise exist
    for png in ("attention_layers.png", "attention_heads.png", "runs.png",
                "attention_variants.png"):
        assert (tmp_path / png).stat().st_size > 10_000, png
