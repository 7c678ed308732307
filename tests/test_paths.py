"""Every path a command takes, checked before any work (``minigpt.paths``): each path-taking key
of each entry point's schema, with each bad thing that can stand at a path, is one line naming
the key, the path, what is wrong and the fix; a key named like a path must be marked; and the
check answers before a model is built or data is read."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from minigpt.config import (
    EvalCommandSchema,
    GenerateSchema,
    PrepareSchema,
    TrainSchema,
    VizSchema,
)
from minigpt.paths import (
    INPUT_DIR,
    INPUT_FILE,
    INPUT_FILE_OR_DIR,
    INPUT_GLOBS,
    NOT_A_PATH,
    OUTPUT_DIR,
    OUTPUT_FILE,
    MissingPathError,
    PathError,
    PathRole,
    check_paths,
    marked_paths,
    path_problems,
    value_problems,
)
from minigpt.serve.config import ServeSchema

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINTS = {"train.py": TrainSchema, "python -m minigpt.data": PrepareSchema,
                "generate.py": GenerateSchema, "python -m minigpt.eval": EvalCommandSchema,
                "python -m minigpt.viz": VizSchema, "python -m minigpt.serve": ServeSchema}
# A field whose name says it holds a path (or that is known to) must say what kind.
LOOKS_LIKE_A_PATH = re.compile(r"path|dir|file|root|shards|^out$|_input$|_output$|^prompts?$|"
                               r"^init_from$|^pretrained$|^attention_map$|^runs$")
IS_ROOT = os.geteuid() == 0


def all_marked():
    """``(entry point, key, role, field)`` of every marked path field of every entry point."""
    return [(program, key, role, f) for program, schema in ENTRY_POINTS.items()
            for key, role, f in marked_paths(schema)
            if role is not None and role.kind != NOT_A_PATH]


def test_every_field_named_like_a_path_is_marked():
    unmarked = [f"{program}: {key}" for program, schema in ENTRY_POINTS.items()
                for key, role, f in marked_paths(schema)
                if LOOKS_LIKE_A_PATH.search(f.name) and role is None]
    assert unmarked == [], f"mark these with minigpt.paths.path_field: {unmarked}"
    keys = {key for _, key, _, _ in all_marked()}
    assert {"data.train_shards", "data.source_args.val_paths", "chat_output", "include_path",
            "ckpt_path", "data_root", "runs"} <= keys  # the walk reaches into every level


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> dict[str, Path]:
    """Each thing that can stand where a path is wanted, but should not."""
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "dir" / "sub.bin").mkdir(parents=True)
    (tmp / "dir" / "a.bin").write_bytes(b"x")
    (tmp / "file.txt").write_text("text\n")
    (tmp / "loop").symlink_to(tmp / "loop")
    (tmp / "broken").symlink_to(tmp / "nowhere")
    os.mkfifo(tmp / "fifo")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp / "socket"))
    return {"missing": tmp / "missing", "dir": tmp / "dir", "file": tmp / "file.txt",
            "loop": tmp / "loop", "broken": tmp / "broken", "fifo": tmp / "fifo",
            "socket": tmp / "socket", "under a file": tmp / "file.txt" / "x",
            "in a missing dir": tmp / "missing" / "x", "proc": Path("/proc/x")}


def cases(kind: str, bad: dict[str, Path]) -> list[tuple[str, str]]:
    """``(value, what the line must say)`` for each bad value of an input or output ``kind``."""
    given = {"missing": (bad["missing"], "does not exist"),
             "loop": (bad["loop"], "is a symbolic link loop"),
             "broken": (bad["broken"], "is a broken symbolic link"),
             "fifo": (bad["fifo"], "is a FIFO, not a"),
             "socket": (bad["socket"], "is a socket, not a"),
             "under a file": (bad["under a file"], "does not exist")}
    if kind in (INPUT_FILE, INPUT_GLOBS):
        given["dir"] = (bad["dir"], "is a directory")
    if kind == INPUT_DIR:
        given["file"] = (bad["file"], "is a file, not a directory")
    if kind == INPUT_GLOBS:
        given |= {"empty glob": (f"{bad['dir']}/*.txt", "matches no files"),
                  "directory matched": (f"{bad['dir']}/*.bin", f"matches the directory "
                                        f"{bad['dir'] / 'sub.bin'}"),
                  "loop matched": (f"{bad['loop']}*", "which is a symbolic link loop")}
    if kind == OUTPUT_FILE:
        given = {"dir": (bad["dir"], "is a directory, not a file"),
                 "in a missing dir": (bad["in a missing dir"], "is in a directory that does "
                                      "not exist"),
                 "under a file": (bad["under a file"], "is a file, not a directory"),
                 "proc": (bad["proc"], "cannot be written: no file can be created in /proc")}
    if kind == OUTPUT_DIR:
        given = {"file": (bad["file"], "is a file, not a directory"),
                 "under a file": (bad["under a file"], "is a file, not a directory"),
                 "proc": (Path("/proc/sys"), "is read-only: no file can be created in")}
    return [(str(value), expected) for value, expected in given.values()]


@pytest.mark.parametrize("program, key, role, f", all_marked(),
                         ids=[f"{p}:{k}" for p, k, _, _ in all_marked()])
def test_each_path_key_names_each_bad_path_in_one_line(program, key, role, f, bad):
    listed = f.default_factory is list
    for value, expected in cases(role.kind, bad):
        given = "@" + value if role.at_file else value
        lines = value_problems(key, [given] if listed else given, role)
        shown = f"{key}[0]={given}" if listed else f"{key}={given}"
        assert len(lines) == 1 and "\n" not in lines[0], (value, lines)
        assert lines[0].startswith(shown + " ") and expected in lines[0], (expected, lines[0])
        assert re.search(r"[:;] (give|check|fix|point|make|write|narrow|use)\b", lines[0]), \
            f"no fix in: {lines[0]}"


@pytest.mark.parametrize("kind", [INPUT_FILE, INPUT_FILE_OR_DIR, INPUT_DIR])
def test_unreadable_paths_are_tried_not_asked(kind, bad, monkeypatch):
    """Root reads anything: ``os.access`` would say yes, so opening (a directory: listing) is
    what decides; here opening is made to fail as it does for another user."""
    import minigpt.paths as paths

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(paths, "open", refuse, raising=False)
    monkeypatch.setattr(paths.os, "scandir", refuse)
    target = bad["dir"] if kind == INPUT_DIR else bad["file"]
    [line] = value_problems("k", str(target), paths.PathRole(kind))
    assert "Permission denied" in line and ("cannot be read" in line or "cannot read" in line)


def test_an_output_file_under_missing_directories_where_none_can_be_made(tmp_path):
    """A missing directory is made with mkdir -p where that can work; under /proc (or a
    read-only filesystem) no file can be created, so that is what is said instead."""
    under_proc = value_problems("out", "/proc/nothing/r.json", PathRole(OUTPUT_FILE))
    assert under_proc == ["out=/proc/nothing/r.json cannot be written: no file can be created "
                          "in /proc (No such file or directory); write it somewhere else"]
    missing = tmp_path / "a" / "b"
    assert value_problems("out", str(missing / "r.json"), PathRole(OUTPUT_FILE)) == [
        f"out={missing / 'r.json'} is in a directory that does not exist ({missing}): make it "
        f"first (mkdir -p {missing}) or write elsewhere"]


def test_a_read_only_filesystem_is_named(tmp_path):
    """EROFS: only a write attempt tells (the modes say writable)."""
    from fault_helpers import small_tmpfs

    with small_tmpfs(tmp_path / "disk", size="64k") as disk:
        (disk / "sub").mkdir()
        if subprocess.run(["mount", "-o", "remount,ro", str(disk)],
                          capture_output=True).returncode != 0:
            pytest.skip("cannot remount the tmpfs read-only here")
        out = value_problems("chat_output", str(disk / "replies.jsonl"), PathRole(OUTPUT_FILE))
        root = value_problems("data_root", str(disk / "sub"), PathRole(OUTPUT_DIR))
    assert out == [f"chat_output={disk / 'replies.jsonl'} cannot be written: no file can be "
                   f"created in {disk} (a read-only filesystem); write it somewhere else"]
    assert root == [f"data_root={disk / 'sub'} is read-only: no file can be created in "
                    f"{disk / 'sub'} (a read-only filesystem); give a directory you can write"]


def test_good_paths_pass_and_words_and_hub_names_are_not_paths(bad, tmp_path):
    assert value_problems("prompt_file", str(bad["file"]), _role(GenerateSchema, "prompt_file")) \
        == []
    assert value_problems("prompt", "plain text, not a file", _role(GenerateSchema, "prompt")) \
        == []
    assert value_problems("ckpt_path", "last", _role(TrainSchema, "ckpt_path")) == []
    assert value_problems("pretrained", "gpt2", _role(GenerateSchema, "pretrained")) == []
    assert value_problems("data_root", str(tmp_path / "new" / "deeper"),
                          _role(TrainSchema, "data_root")) == []  # made when needed
    assert value_problems("out", str(tmp_path / "result.json"),
                          _role(EvalCommandSchema, "out")) == []
    assert list(tmp_path.iterdir()) == []  # the write check leaves nothing behind
    recursive = _role(TrainSchema, "data.paths")  # ** walks into directories: they are fine
    assert value_problems("data.paths", [f"{bad['dir']}/**/*.bin"], recursive) == []


def _role(schema, key):
    return next(role for k, role, _ in marked_paths(schema) if k == key)


def _settings_with(schema, key: str, value):
    """``schema``'s defaults with ``key`` (dotted) set to ``value``, and what makes it read."""
    settings = schema()
    if schema is VizSchema and key == "runs":
        settings.command = "runs"
    if key.startswith("data.source_args."):
        settings.data.source = "chat"
        settings.data.source_args = {key.rpartition(".")[2]: value}
        return settings
    owner = settings
    *parents, name = key.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    setattr(owner, name, value)
    return settings


@pytest.mark.parametrize("program, key, role, f", all_marked(),
                         ids=[f"{p}:{k}" for p, k, _, _ in all_marked()])
def test_the_schema_walk_reaches_every_marked_key(program, key, role, f, bad):
    value = str(bad["in a missing dir"] if role.kind == OUTPUT_FILE else bad["under a file"])
    value = "@" + value if role.at_file else value
    settings = _settings_with(ENTRY_POINTS[program], key, [value] if f.default_factory is list
                              else value)
    assert any(line.startswith(key) for line in path_problems(settings)), key


def test_check_paths_is_one_line_for_all_and_skips_keys_not_read(bad):
    settings = GenerateSchema(chat=True, chat_input=str(bad["dir"]), chat_output="/proc/x",
                              pretrained="gpt2")
    with pytest.raises(PathError) as error:
        check_paths(settings)
    message = str(error.value)
    assert "\n" not in message and message.count("; chat_output=") == 1
    assert message.startswith(f"chat_input={bad['dir']} is a directory, not a file")
    assert "checkpoints_root" not in message  # pretrained names the model: the root is not read
    with pytest.raises(MissingPathError, match="prompt_file=.* does not exist"):
        check_paths(GenerateSchema(prompt_file=str(bad["missing"]), pretrained="gpt2"))
    with pytest.raises(MissingPathError, match="checkpoints_root=.* give ckpt_path=FILE or "
                                               "pretrained=DIR"):
        check_paths(EvalCommandSchema(checkpoints_root=str(bad["missing"])))
    shards = TrainSchema()
    shards.data.source = "shards"
    shards.data_root = str(bad["file"])  # not read for token shards
    assert path_problems(shards) == []


# ---- the order: no model built, no data read ------------------------------------------------

def _refuse(what: str):
    def refused(*args, **kwargs):
        raise AssertionError(f"{what} before the paths were checked")
    return refused


def test_a_bad_path_answers_before_any_model_or_data(bad, tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir

    import minigpt.data.shards
    import minigpt.inference
    from generate import run as generate
    from minigpt.config import register_schemas
    from minigpt.eval.run import run as evaluate
    from minigpt.model import GPT
    from minigpt.train.run import run as train

    monkeypatch.setattr(GPT, "__init__", _refuse("a model was built"))
    monkeypatch.setattr(minigpt.data.shards, "read_header", _refuse("a shard was read"))
    for name in ("load_for_inference", "load_for_scoring"):
        monkeypatch.setattr(minigpt.inference, name, _refuse("a model was loaded"))
    register_schemas()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=["data=shards", "logger=none",
                                          f"data.train_shards={bad['dir']}/*.bin",
                                          f"data.val_shards={bad['loop']}"])
    with pytest.raises(PathError) as error:
        train(cfg, run_dir=tmp_path / "run")
    assert str(error.value).startswith(f"data.train_shards={bad['dir']}/*.bin matches the "
                                       "directory")
    assert f"data.val_shards={bad['loop']} is a symbolic link loop" in str(error.value)
    assert not (tmp_path / "run").exists()  # nothing left of the run
    with pytest.raises(PathError, match=r"chat_output=/proc/x cannot be written"):
        generate(GenerateSchema(chat=True, chat_input=str(bad["file"]), chat_output="/proc/x",
                                pretrained="gpt2"))
    with pytest.raises(PathError, match=r"prompt=@.* is a directory, not a file"):
        generate(GenerateSchema(prompt=f"@{bad['dir']}", pretrained="gpt2"))
    with pytest.raises(PathError, match=r"out=.* is a directory, not a file"):
        evaluate(EvalCommandSchema(out=str(bad["dir"]), path=str(bad["file"]),
                                   pretrained="gpt2"))
    with pytest.raises(MissingPathError, match=r"include_path=.*missing does not exist"):
        evaluate(EvalCommandSchema(task="harness", tasks="x", include_path=str(bad["missing"]),
                                   pretrained="gpt2"))


# ---- the real command lines --------------------------------------------------------------------

def cli(cwd: Path, program: str, *args: str, importtime: bool = False):
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, *(["-X", "importtime"] if importtime else [])]
    command += [str(ROOT / program)] if program.endswith(".py") else ["-m", program]
    return subprocess.run([*command, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_command_lines_answer_in_one_line_without_lightning(bad, tmp_path):
    items = tmp_path / "items.jsonl"
    items.write_text('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 0}\n')
    table = [  # the first runs with -X importtime: Lightning must not be imported
        (("train.py", "data=shards", f"data.train_shards={bad['dir']}/*.bin",
          f"data.val_shards={bad['loop']}"),
         f"error: data.train_shards={bad['dir']}/*.bin matches the directory "
         f"{bad['dir'] / 'sub.bin'}: narrow the glob to files, or use ** to read the files under "
         f"directories; data.val_shards={bad['loop']} is a symbolic link loop"),
        (("train.py", "data=chat", f"data.paths=[{items}]",
          f"data.source_args.val_paths=[{bad['missing']}.jsonl]"),
         f"error: data.source_args.val_paths[0]={bad['missing']}.jsonl does not exist"),
        (("generate.py", "chat=true", f"chat_input={items}", "chat_output=/proc/x",
          "pretrained=gpt2"), "error: chat_output=/proc/x cannot be written"),
        (("minigpt.eval", f"out={bad['dir']}", f"path={items}", "pretrained=gpt2"),
         f"error: out={bad['dir']} is a directory, not a file"),
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda i: cli(tmp_path, *table[i][0], importtime=i == 0),
                                range(len(table))))
    for (args, expected), result in zip(table, results, strict=True):
        lines = [line for line in result.stderr.strip().splitlines()
                 if not line.startswith("import time:")]
        assert result.returncode == 2 and len(lines) == 1, (args, result.stderr[-2000:])
        assert lines[0].startswith(expected), (expected, lines[0])
    imported = [line for line in results[0].stderr.splitlines() if line.startswith("import time:")]
    assert imported and not [line for line in imported if re.search(r"\| +lightning(\.|$)", line)]
    assert not [p for p in (tmp_path / "outputs").rglob("*")] \
        if (tmp_path / "outputs").exists() else True  # no run directory left behind
