"""minigpt.cpu.tuning: the timings file (measured once per machine, then read) and the rule
that picks a kernel."""

import json

import pytest

from minigpt.cpu.tuning import MARGIN, Choice, KernelChoices, describe, machine_key, pick


def test_pick_leaves_the_default_unless_a_kernel_is_margin_faster():
    assert pick({"mkl": 1.0, "onednn": 1.0 / (MARGIN * 0.99)}, "mkl") == Choice("mkl", 1.0, False)
    assert pick({"mkl": 1.0, "onednn": 0.5}, "mkl", cached=True) == Choice("onednn", 2.0, True)
    assert pick({"plain": 1.0, "mkl": 0.8, "onednn": 0.5}, "plain").kernel == "onednn"
    assert pick({"onednn": 0.5}, "mkl").kernel == "mkl"  # no default timing: keep the default


def test_timings_are_measured_once_then_read_from_the_file(tmp_path):
    path = tmp_path / "sub" / "kernels.json"
    asked = []

    def measure(keys):
        asked.append(keys)
        return {k: {"mkl": 1.0, "onednn": float(len(k))} for k in keys}

    store = KernelChoices(path)
    timings, cached = store.timings(["a", "bb", "a"], measure)
    assert timings == {"a": {"mkl": 1.0, "onednn": 1.0}, "bb": {"mkl": 1.0, "onednn": 2.0}}
    assert cached == set() and asked == [["a", "bb"]]
    timings, cached = KernelChoices(path).timings(["bb", "ccc"], measure)  # a later run
    assert asked == [["a", "bb"], ["ccc"]] and cached == {"bb"}
    stored = json.loads(path.read_text())
    assert list(stored) == [machine_key()]  # one entry per CPU model, torch version, threads
    assert sorted(stored[machine_key()]) == ["a", "bb", "ccc"]
    assert list(path.parent.iterdir()) == [path]  # written atomically: no temporary file left


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"%s": {"a": {"mkl": "fast"}}}'])
def test_a_malformed_file_is_measured_again_and_rewritten(tmp_path, text):
    path = tmp_path / "kernels.json"
    path.write_text(text.replace("%s", machine_key()))
    timings, cached = KernelChoices(path).timings(["a"], lambda keys: {"a": {"mkl": 2.0}})
    assert timings == {"a": {"mkl": 2.0}} and cached == set()
    assert json.loads(path.read_text())[machine_key()] == {"a": {"mkl": 2.0}}


def test_other_machines_entries_are_kept(tmp_path):
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps({"Another CPU | torch 0.1 | 1 threads": {"a": {"mkl": 1.0}}}))
    KernelChoices(path).timings(["a"], lambda keys: {"a": {"mkl": 3.0}})
    assert set(json.loads(path.read_text())) == {"Another CPU | torch 0.1 | 1 threads",
                                                 machine_key()}


def test_the_cache_directory_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path / "mine"))
    assert KernelChoices().path == tmp_path / "mine" / "cpu_kernels.json"
    monkeypatch.delenv("MINIGPT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert KernelChoices().path == tmp_path / "xdg" / "minigpt" / "cpu_kernels.json"


def test_describe_names_the_source_and_the_speedups():
    assert describe({"a": Choice("mkl", 1.0, False)}, "mkl") == "not faster here"
    assert describe({"a": Choice("onednn", 1.3, True), "b": Choice("mkl", 1.0, False)},
                    "mkl") == "cached x1.30"
    assert describe({"a": Choice("onednn", 1.3, True), "b": Choice("onednn", 1.6, False)},
                    "mkl") == "measured x1.30-1.60"
