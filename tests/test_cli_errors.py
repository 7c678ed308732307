"""Bad input through the real command lines: exit status 2, one line on stderr naming the bad
value, nothing written that looks complete, and no time lost on heavy work first."""

from __future__ import annotations

import contextlib
import os
import re
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
PROGRESS = re.compile(r"\d+/\d+ \[")  # a tqdm bar: preparation's, not an error


def cli(tmp: Path, program: str, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    modules = {"prepare": "minigpt.data", "eval": "minigpt.eval", "checkpoint": "minigpt.checkpoint"}
    command = [sys.executable, "-m", modules[program]] if program in modules else \
        [sys.executable, str(ROOT / program)]
    start = time.perf_counter()
    result = subprocess.run([*command, *args], cwd=tmp, env=env, capture_output=True, text=True,
                            timeout=300)
    return result, time.perf_counter() - start


def hf_dirs(tmp: Path) -> dict[str, Path]:
    """Hugging Face directories a user might hand us, each broken in one way: a
    pytorch_model.bin carrying code, a model.safetensors cut short, one with a misshapen weight, a
    config.json that is not JSON."""
    from payload import save_with_payload
    from safetensors.torch import load_file, save_file

    from minigpt.model import GPT, GPTConfig

    dirs = {}
    for name in ("good", "code", "cut", "shape", "json"):
        dirs[name] = tmp / f"hf-{name}"
        GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, context_length=16, vocab_size=100)) \
            .save_pretrained(dirs[name])
    (dirs["code"] / "model.safetensors").unlink()
    save_with_payload(dirs["code"] / "pytorch_model.bin", tmp / "payload-ran")
    weights = (dirs["cut"] / "model.safetensors").read_bytes()
    (dirs["cut"] / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    tensors = load_file(dirs["shape"] / "model.safetensors")
    tensors["transformer.wte.weight"] = tensors["transformer.wte.weight"][:50]
    save_file(tensors, dirs["shape"] / "model.safetensors")
    (dirs["json"] / "config.json").write_text('{"n_layer": 1,')
    return dirs


def read_only_dir(tmp: Path) -> Path | None:
    """A directory this process cannot write (root ignores modes: /proc/sys then), or None."""
    path = tmp / "read-only"
    path.mkdir(mode=0o555)
    for candidate in (path, Path("/proc/sys")):
        if not os.access(candidate, os.W_OK):
            return candidate
    return None


def bad_files(tmp: Path) -> dict[str, Path]:
    """Files a user might hand us that do not hold what they should: an image named .txt, text
    in latin-1 where UTF-8 is expected, and one JSON line nested 100,000 levels deep (Python's
    reader recurses per level, pyarrow's crashed the process)."""
    (tmp / "mixed").mkdir()
    files = {"png": tmp / "mixed" / "picture.txt", "latin1": tmp / "mixed" / "old.txt",
             "deep": tmp / "deep.jsonl"}
    files["png"].write_bytes(b"a caption\n\x89PNG\x00\x00\x00\rIHDR\x00\x00")
    files["latin1"].write_bytes("first prompt\ncafé\n".encode("latin-1"))
    files["deep"].write_text('{"ctx": "a", "text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    return files


def cases(tmp: Path, checkpoint: Path) -> list[tuple[str, str, list[str], str]]:
    """(case, program, arguments, text the one line must contain); ``checkpoint`` is the
    fixture's 3-step run."""
    from payload import save_with_payload

    code_ckpt = save_with_payload(tmp / "code.ckpt", tmp / "payload-ran")
    hf = hf_dirs(tmp)
    (tmp / "a-file").write_text("not a directory")
    (tmp / "latin1").mkdir()
    (tmp / "latin1" / "a.txt").write_bytes("café, naïve façade. ".encode("latin-1") * 20)
    read_only = read_only_dir(tmp)
    truncated = tmp / "truncated.ckpt"
    truncated.write_bytes(checkpoint.read_bytes()[:20_000])
    (tmp / "corpus").mkdir()
    (tmp / "corpus" / "good.txt").write_text("plain text " * 20)
    for name in ("bad1.txt", "bad2.txt"):
        (tmp / "corpus" / name).write_bytes(b"\xff\xfe\x00 not utf-8 \xc3\x28" * 20)
    data = f"data_root={tmp / 'data'}"
    files = bad_files(tmp)
    (tmp / "taken" / "checkpoints").mkdir(parents=True)  # another run's directory
    (tmp / "taken" / "checkpoints" / "best.ckpt").write_bytes(b"theirs")
    return [
        ("huge context", "train.py", ["model.context_length=100000", data, *QUIET],
         "model.context_length=100000"),
        ("a GPU this machine lacks", "train.py", ["trainer.accelerator=gpu", data, *QUIET],
         "trainer.accelerator=gpu but this machine has no GPU"),
        ("FSDP without GPUs", "train.py", ["trainer.strategy=fsdp", data, *QUIET],
         "trainer.strategy=fsdp runs on GPUs and this machine has none"),
        ("Muon under FSDP", "train.py", ["optim=muon", "trainer.strategy=fsdp", data, *QUIET],
         "fsdp"),
        ("another run's directory", "train.py",
         [f"hydra.run.dir={tmp / 'taken'}", data, *QUIET], "holds another run's checkpoints"),
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
        # a typed config: misspelled keys, with and without +, and values of the wrong type
        ("misspelled key added with +", "train.py", ["+optim.learning_rate=1e-3", data, *QUIET],
         "unknown config key optim.learning_rate: did you mean optim.lr?"),
        ("misspelled key", "train.py", ["trainer.max_step=5", data, *QUIET],
         "unknown config key trainer.max_step: did you mean trainer.max_steps?"),
        ("value of the wrong type", "train.py", ["trainer.max_steps=many", data, *QUIET],
         "trainer.max_steps='many' does not fit its type"),
        ("misspelled sampling key", "generate.py", ["+temprature=0.5"],
         "unknown config key temprature: did you mean temperature?"),
        ("misspelled data key", "prepare", ["+data.encodng=latin-1", data],
         "unknown config key data.encodng: did you mean data.encoding?"),
        ("misspelled eval key", "eval", ["+limt=3"],
         "unknown config key limt: did you mean limit?"),
        # values out of their range, and rules across fields (minigpt/config/rules.py)
        ("Muon momentum out of range", "train.py", ["optim.muon_momentum=1.5", data, *QUIET],
         "optim.muon_momentum=1.5 must be a number in [0, 1)"),
        ("Muon lr rule that does not exist", "train.py",
         ["optim=muon", "optim.muon_adjust_lr=banana", data, *QUIET],
         "optim.muon_adjust_lr='banana' must be one of original, match_rms_adamw or null"),
        ("stop at a target that is not set", "train.py",
         ["trainer.stop_at_target=true", data, *QUIET],
         "trainer.stop_at_target=true needs trainer.target_val_loss"),
        ("eval batch of nothing", "eval", ["batch_size=0", "dtype=float8"],
         "batch_size=0 must be a positive integer; dtype='float8' must be one of auto, float32"),
        # files a user hands us
        ("checkpoint carrying code", "generate.py", [f"ckpt_path={code_ckpt}"],
         f"{code_ckpt} holds Python objects"),
        ("pytorch_model.bin carrying code", "generate.py", [f"pretrained={hf['code']}"],
         f"{hf['code'] / 'pytorch_model.bin'} holds Python objects"),
        ("cut-short model.safetensors", "generate.py", [f"pretrained={hf['cut']}"],
         f"{hf['cut'] / 'model.safetensors'} is not a readable safetensors file"),
        ("misshapen model.safetensors", "generate.py", [f"pretrained={hf['shape']}"],
         "tok_emb.weight has shape (50, 8), but config.json (n_embd=8, vocab_size=100)"),
        ("broken config.json", "generate.py", [f"pretrained={hf['json']}"],
         f"{hf['json'] / 'config.json'} is not readable JSON"),
        ("init_from with a longer context", "train.py",
         [f"model.init_from={hf['good']}", "model.context_length=32", *FIXTURE_MODEL[:3], data,
          *QUIET], "context_length=32 exceeds the checkpoint's n_positions=16"),
        ("corpus in another encoding", "prepare",
         ["data=local_files", f"data.paths=[{tmp / 'latin1'}/*.txt]", data],
         "set data.encoding to theirs (perhaps latin-1 or cp1252)"),
        ("data_root a file", "train.py", [f"data_root={tmp / 'a-file'}", *QUIET],
         f"data_root={tmp / 'a-file'} is a file"),
        *([("data_root read-only", "prepare", [f"data_root={read_only}"],
            f"data_root={read_only} is read-only")] if read_only else []),
        # content that is not what the file should hold: named by file and line
        ("binary prompt file", "generate.py", [f"prompt=@{files['png']}", f"pretrained={hf['good']}"],
         f"prompt file {files['png']}:2: binary content (a NUL byte), not text"),
        ("undecodable prompts file", "generate.py",
         [f"prompts=@{files['latin1']}", f"pretrained={hf['good']}"],
         f"prompt file {files['latin1']}:2: byte 0xe9 at column 4 is not utf-8 text"),
        ("binary eval file", "eval", [f"path={files['png']}", f"pretrained={hf['good']}"],
         f"{files['png']}:2: binary content (a NUL byte), not text"),
        ("deeply nested eval line", "eval", [f"path={files['deep']}", f"pretrained={hf['good']}"],
         f"{files['deep']}:1: JSON nested too deeply to read"),
        ("binary file in a corpus", "prepare",
         ["data=local_files", f"data.paths=[{files['png'].parent}/*.txt]", data],
         f"{files['png']}:2: binary content (a NUL byte), not text"),
        ("deeply nested corpus record", "prepare",
         ["data=local_files", f"data.paths=[{files['deep']}]", data],
         f"{files['deep']}:1: JSON nested more than 1000 levels deep"),
        # auxiliary work's settings, checked before the first step
        ("HellaSwag in a char-level run", "train.py", ["eval.every=1", data, *QUIET],
         "eval.every=1 scores HellaSwag, which needs the GPT-2 tokenizer; data.tokenizer=char"),
        ("sampling limit spelled for Python", "generate.py",
         ["top_p=2.0", f"pretrained={hf['good']}"], "top_p=2.0 must be in (0, 1] (or null"),
        # checkpoint tools
        ("consolidate a missing directory", "checkpoint",
         ["consolidate", str(tmp / "no-such-run")], f"{tmp / 'no-such-run'} does not exist"),
        ("consolidate a directory without checkpoints", "checkpoint",
         ["consolidate", str(tmp / "corpus")],
         f"{tmp / 'corpus'} is neither a sharded checkpoint directory"),
        ("consolidate a whole-file checkpoint", "checkpoint", ["consolidate", str(checkpoint)],
         f"{checkpoint} is one whole checkpoint file, not a sharded one: it needs no"),
        # settings this machine cannot run
        ("device it lacks", "generate.py", ["device=cuda:99", f"pretrained={hf['good']}"],
         "device='cuda:99' is not on this machine"),
        ("device that does not exist", "generate.py", ["device=gpu", f"pretrained={hf['good']}"],
         "device='gpu' is not a device name; this machine offers device=cpu"),
    ]


def test_bad_inputs_are_one_line_and_exit_2(tmp_path, checkpoint_v1):
    table = cases(tmp_path, checkpoint_v1)
    with ThreadPoolExecutor(max_workers=2) as pool:  # each is mostly interpreter start-up
        results = list(pool.map(lambda c: cli(tmp_path, c[1], *c[2]), table))
    for (case, _, _, expected), (result, seconds) in zip(table, results, strict=True):
        # What preparation says it is reading, and its progress bars, are not part of the error.
        lines = [line for line in result.stderr.strip().splitlines()
                 if line.strip() and not line.startswith("reading paths")
                 and not PROGRESS.search(line)]
        assert result.returncode == 2, (case, result.stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: "), (case, lines)
        assert expected in lines[0], (case, lines[0])
        assert "Traceback" not in result.stderr and "weights_only=False" not in lines[0], case
        assert seconds < 60, (case, seconds)
    assert not (tmp_path / "payload-ran").exists()  # no payload ever ran
    # Nothing that looks complete: no checkpoint, no summary, no prepared local_files data.
    for pattern in ("*.ckpt", "summary.json"):
        written = [p for p in (tmp_path / "outputs").rglob(pattern)] \
            if (tmp_path / "outputs").exists() else []
        assert written == [], written
    # and no run directory left by a failed start (an empty outputs/ may stay)
    assert not [p for p in (tmp_path / "outputs").rglob("*")] \
        if (tmp_path / "outputs").exists() else True
    assert (tmp_path / "taken" / "checkpoints" / "best.ckpt").read_bytes() == b"theirs"
    assert not (tmp_path / "data" / "local_files" / "meta.json").exists()
    assert not list((tmp_path / "read-only").iterdir())


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


def test_a_second_writer_of_a_run_directory_is_refused_and_changes_nothing(tmp_path,
                                                                          checkpoint_v1):
    """Resuming a run in place while another process trains it: one line naming that process,
    and nothing of the holder's touched (its lock, its checkpoints)."""
    from fault_helpers import hold_in_another_process

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(checkpoint_v1.read_bytes())
    holder = hold_in_another_process(run_dir)
    try:
        result, _ = cli(tmp_path, "train.py", f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}",
                        f"hydra.run.dir={run_dir}", *FIXTURE_MODEL, f"data_root={tmp_path}/data",
                        *QUIET)
        lock_text = (run_dir / ".writer.lock").read_text()
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: {run_dir} is in use by another training process (pid {holder.pid} on "), lines
    assert lock_text.split()[0] == str(holder.pid)  # the holder's lock is untouched
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["last.ckpt"]
    assert not (run_dir / "config.yaml").exists() and not (run_dir / "csv").exists()


def test_a_full_disk_is_one_line_and_keeps_the_previous_result(tmp_path):
    """``python -m minigpt.eval out=`` onto a full filesystem: exit 2, one line naming the file
    and the fix; the previous result file intact and no partial file beside it."""
    from fault_helpers import small_tmpfs

    from minigpt.model import GPT, GPTConfig

    model = tmp_path / "gpt2-vocab"  # HellaSwag scores with the GPT-2 tokenizer
    GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, context_length=16)).save_pretrained(model)
    items = tmp_path / "items.jsonl"
    items.write_text('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 0}\n')
    with small_tmpfs(tmp_path / "small", size="64k") as disk:
        result = disk / "result.json"
        result.write_text('{"previous": true}\n')
        with open(disk / "filler", "wb", buffering=0) as f:  # fill it to the last block
            with contextlib.suppress(OSError):
                while f.write(b"\0" * 4096):
                    pass
        done, _ = cli(tmp_path, "eval", f"pretrained={model}", f"path={items}",
                      f"out={result}")
        left = sorted(p.name for p in disk.iterdir())
        previous = result.read_text()
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert lines[0].startswith(f"error: {result}: no space left on the device"), lines
    assert "free disk space there or write to another directory" in lines[0]
    assert previous == '{"previous": true}\n' and left == ["filler", "result.json"]


def test_a_full_disk_at_the_first_checkpoint_is_one_line_saying_so(tmp_path):
    """``python train.py`` with its run directory on a filesystem too small for one checkpoint
    (about 420 KB): exit 2, one line naming the checkpoint, the bytes and that none is on disk;
    no partial file left, nothing staged in the system temp directory."""
    from fault_helpers import small_tmpfs

    system_temp = tmp_path / "system-temp"
    system_temp.mkdir()
    tiny = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.context_length=32",
            "data.batch_size=4", "data.val_tokens=256", "trainer.max_steps=2",
            "trainer.val_check_interval=2", f"data_root={tmp_path / 'data'}", *QUIET]
    with small_tmpfs(tmp_path / "small", size="200k") as disk:
        os.environ["TMPDIR"] = str(system_temp)  # cli() passes the environment on
        try:
            done, _ = cli(tmp_path, "train.py", f"hydra.run.dir={disk / 'run'}", *tiny)
        finally:
            del os.environ["TMPDIR"]
        left = sorted(p.name for p in (disk / "run" / "checkpoints").iterdir())
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    ckpt = disk / "run" / "checkpoints" / "best.ckpt"
    assert lines[0].startswith(f"error: {ckpt}: no space left on the device ("), lines
    assert "this was the run's first checkpoint, so none is on disk" in lines[0]
    assert left == []
    # torch makes its compiler's cache directory there; no file was staged
    assert [p for p in system_temp.rglob("*") if p.is_file()] == []


ENDINGS = {  # how the process body ends -> its exit status in a group, alone, and on stderr
    "raise SystemExit(2)": (2, 2, ""),
    "raise SystemExit(130)": (130, 130, ""),
    "raise SystemExit('error: a one-line message')": (1, 1, "error: a one-line message"),
    "raise RuntimeError('a bug')": (1, 1, "RuntimeError: a bug"),
    "raise KeyboardInterrupt": (130, -2, "KeyboardInterrupt"),  # alone: Python re-raises SIGINT
}


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_failing_process_of_a_process_group_ends_at_once_with_its_status(tmp_path, ending):
    """In a gloo process group, a failure skips interpreter shutdown (whose teardown of the group
    can hang or abort): the status and the output stay, and no exit handler runs; the same body
    outside a group ends as usual, and a success inside one too."""
    in_group, alone, said = ENDINGS[ending]
    for grouped, body in [(True, ending), (False, ending), (True, "print('done')")]:
        script = (
            "import atexit, torch.distributed as dist\n"
            "from minigpt.errors import ending_distributed_failures_at_once\n"
            "atexit.register(print, 'exit handlers ran')\n"
            "with ending_distributed_failures_at_once():\n"
            f"    if {grouped}:\n"
            f"        dist.init_process_group('gloo', init_method='file://{tmp_path}/store"
            f"{len(body)}{grouped}', rank=0, world_size=1)\n"
            "    print('before', flush=False)\n"
            f"    {body}\n")
        result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                                text=True, timeout=120)
        expected = 0 if body != ending else in_group if grouped else alone
        assert result.returncode == expected, (grouped, body, result.stderr[-2000:])
        assert result.stdout.startswith("before"), result.stdout  # flushed before the exit
        assert body != ending or said in result.stderr
        ran = "exit handlers ran" in result.stdout
        assert ran == (not grouped or body != ending), (grouped, body, result.stdout)
