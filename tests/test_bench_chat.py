"""bench/chat.py on a tiny model, so the benchmark never rots: a row per turn, the kept cache and
re-reading the history give the same replies, and the history grows turn by turn."""

import pytest

from bench import chat as bench

pytestmark = pytest.mark.usefixtures("one_thread")


def test_tiny_run_prints_a_row_per_turn(capsys):
    bench.main(["--threads", "1", "--turns", "3", "--layers", "1", "--embd", "64",
                "--user-tokens", "6", "--reply-tokens", "4", "--warmup", "0", "--repeats", "1"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[3:6]]
    assert [int(r[0]) for r in rows] == [1, 2, 3]
    history = [int(r[1]) for r in rows]
    assert history[0] == 1 and history[1] > history[0] + 4 + 6 and history[2] > history[1]
    assert lines[-1].endswith("equal replies in 3 of 3 turns (last conversation)")
