"""minigpt.cpu.tuning: the timings file (measured once per machine, then read) and the rule
that picks a kernel."""

import json

import pytest

from minigpt.cpu import tuning
from minigpt.cpu.tuning import (
    CLOSE_CALL_RUNS,
    MARGIN,
    Choice,
    KernelChoices,
    describe,
    machine_key,
    pick,
    shape_of,
)


def test_pick_leaves_the_default_unless_a_kernel_is_margin_faster():
    close = pick({"mkl": 1.0, "onednn": 1.0 / (MARGIN * 0.99)}, "mkl")
    assert (close.kernel, close.speedup, close.cached) == ("mkl", 1.0, False)
    assert close.ratio == pytest.approx(MARGIN * 0.99)  # measured, not applied
    assert pick({"mkl": 1.0, "onednn": 0.5}, "mkl", cached=True) == Choice("onednn", 2.0, True,
                                                                           2.0)
    assert pick({"plain": 1.0, "mkl": 0.8, "onednn": 0.5}, "plain").kernel == "onednn"
    assert pick({"plain": 1.0, "mkl": 2.0}, "plain").ratio == 0.5  # slower: ratio below 1
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
    assert stored[machine_key()]["bb"] == {"seconds": {"mkl": 1.0, "onednn": 2.0}, "load": 0.0,
                                           "runs": 1}
    assert list(path.parent.iterdir()) == [path]  # written atomically: no temporary file left


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"%s": {"a": {"mkl": "fast"}}}'])
def test_a_malformed_file_is_measured_again_and_rewritten(tmp_path, text):
    path = tmp_path / "kernels.json"
    path.write_text(text.replace("%s", machine_key()))
    timings, cached = KernelChoices(path).timings(["a"], lambda keys: {"a": {"mkl": 2.0}})
    assert timings == {"a": {"mkl": 2.0}} and cached == set()
    assert json.loads(path.read_text())[machine_key()]["a"]["seconds"] == {"mkl": 2.0}


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


def test_describe_gives_each_keys_ratio_and_the_source():
    assert describe({"a": Choice("mkl", 1.0, False, 0.97)}) == "a x0.97; measured"
    assert describe({"decode float32 768x2304": Choice("onednn", 1.3, True, 1.3),
                     "decode float32 768x768": Choice("mkl", 1.0, False, 1.02)},
                    shape_of) == "768x2304 x1.30, 768x768 x1.02; 1 of 2 measured"
    assert describe({"a": Choice("onednn", 1.6, True, 1.6)}) == "a x1.60; cached"


def counting_measure(seconds):
    """A ``measure`` returning ``seconds[key]`` (the same dict for every key if not nested)
    and recording each call's keys."""
    asked = []

    def measure(keys):
        asked.append(list(keys))
        return {k: dict(seconds.get(k, seconds)) for k in keys}

    return measure, asked


def test_a_close_call_is_measured_again_until_trusted_and_keeps_the_fastest_times(tmp_path):
    path = tmp_path / "kernels.json"
    measure, asked = counting_measure({"close": {"mkl": 1.0, "onednn": 0.98},
                                       "clear": {"mkl": 1.0, "onednn": 0.5}})
    for run in range(CLOSE_CALL_RUNS + 2):
        timings, cached = KernelChoices(path).timings(["close", "clear"], measure, "mkl")
        assert cached == (set() if run == 0 else {"clear"} if run < CLOSE_CALL_RUNS
                          else {"close", "clear"})
    assert asked == [["close", "clear"]] + [["close"]] * (CLOSE_CALL_RUNS - 1)
    entry = json.loads(path.read_text())[machine_key()]["close"]
    assert entry["runs"] == CLOSE_CALL_RUNS
    # each kernel's fastest time over the measurements is kept
    faster, _ = counting_measure({"mkl": 0.9, "onednn": 1.2})
    KernelChoices(path, retune=False)._write({machine_key(): {"close": {
        "seconds": {"mkl": 1.0, "onednn": 0.98}, "load": 0.0, "runs": 1}}})
    timings, _ = KernelChoices(path).timings(["close"], faster, "mkl")
    assert timings["close"] == {"mkl": 0.9, "onednn": 0.98}


def test_timings_taken_under_load_are_measured_again_once_the_machine_is_quiet(
        tmp_path, monkeypatch):
    path = tmp_path / "kernels.json"
    measure, asked = counting_measure({"mkl": 1.0, "onednn": 0.5})
    load = {"now": 3.0}
    monkeypatch.setattr(tuning, "load_per_core", lambda: load["now"])
    KernelChoices(path).timings(["a"], measure, "mkl")
    KernelChoices(path).timings(["a"], measure, "mkl")  # as loaded as then: trusted
    load["now"] = 1.5
    KernelChoices(path).timings(["a"], measure, "mkl")  # still loaded: not measured again
    assert len(asked) == 1
    load["now"] = 0.4
    KernelChoices(path).timings(["a"], measure, "mkl")  # quiet: measured again
    KernelChoices(path).timings(["a"], measure, "mkl")  # taken quietly now: trusted
    assert len(asked) == 2
    assert json.loads(path.read_text())[machine_key()]["a"]["load"] == 0.4


def test_retune_measures_everything_afresh(tmp_path, monkeypatch):
    path = tmp_path / "kernels.json"
    old, _ = counting_measure({"mkl": 0.1, "onednn": 0.5})
    KernelChoices(path).timings(["a"], old, "mkl")
    new, asked = counting_measure({"mkl": 1.0, "onednn": 0.5})
    monkeypatch.setenv("MINIGPT_CPU_RETUNE", "1")
    timings, cached = KernelChoices(path).timings(["a"], new, "mkl")
    assert asked == [["a"]] and cached == set()
    assert timings["a"] == {"mkl": 1.0, "onednn": 0.5}  # replaced, not merged with the old
    assert KernelChoices(path, retune=False).timings(["a"], new, "mkl")[1] == {"a"}


def test_a_file_from_before_loads_were_stored_is_measured_once_more(tmp_path):
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps({machine_key(): {"a": {"mkl": 1.0, "onednn": 0.5}}}))
    measure, asked = counting_measure({"mkl": 1.0, "onednn": 0.4})
    assert KernelChoices(path).timings(["a"], measure, "mkl")[0]["a"] == {"mkl": 1.0,
                                                                          "onednn": 0.4}
    assert KernelChoices(path).timings(["a"], measure, "mkl")[1] == {"a"}
    assert len(asked) == 1
