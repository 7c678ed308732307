"""bench/serve.py in its tiny self-test mode, so the benchmark never rots: a live server answers
every request in full, the table has its four rows, each target prints a line, the engine's
counts (its GET /metrics) say where its time went, and batching left every greedy text as it was
alone."""

import re

import pytest

from bench import serve as bench

pytestmark = pytest.mark.usefixtures("one_thread")  # restores the thread count the bench sets


def test_self_test_prints_the_table_and_a_line_per_target(capsys):
    bench.main(["--self-test"])
    lines = capsys.readouterr().out.splitlines()
    rows = {line[:34].strip(): line[34:].split() for line in lines[3:7]}
    assert list(rows) == ["one client at a time", "4 clients together",
                          "one client, 16 tokens (server)", "generate.py decode, in process"]
    assert all(float(values[0]) > 0 for values in rows.values())
    targets = [line for line in lines if "(target" in line]
    assert len(targets) == 3
    assert all(re.search(r": \d+\.\d\dx \(target [<>]= [\d.]+x\): (met|NOT met)$", line)
               for line in targets)
    engine = re.fullmatch(r"engine, 4 together: (\d+) decode steps of ([\d.]+) rows on average; "
                          r"per step [\d.]+ ms: forward [\d.]+, sampling [\d.]+, prompts [\d.]+, "
                          r"the rest -?[\d.]+", lines[-2])
    # 4 requests of 8 tokens decoding together: 7 steps after their first tokens, 1-4 rows each
    assert engine and int(engine[1]) >= 7 and 1 <= float(engine[2]) <= 4, lines[-2]
    assert lines[-1].startswith("greedy text together == alone in 4 of 4 requests")


def test_the_first_token_floor_searches_every_grouping(capsys):
    from bench import serve_floor

    # three requests at once, a pass over k prompts costing 1, 1.5, 2 ms: two then one puts the
    # median at 1.5 ms (all three: 2; one then two: 2.5; one by one: 2)
    assert serve_floor.best_schedule([0, 0, 0], [1, 1.5, 2], 0) == (1.5, [2, 1])
    # two arrive at 3 ms: the first is read at once, then each alone (medians: all three 5,
    # one then two 4.5, two then one 4.5, one by one 4; the first token read back 0.5 ms later)
    assert serve_floor.best_schedule([0, 3, 3], [1, 1.5, 2], 0.5) == (4.5, [1, 1, 1])
    serve_floor.main(["--clients", "3", "--warmup", "0", "--repeats", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert "ms to read k of bench.serve's prompts in one pass, k = 1 .. 3:" in lines[0]
    assert all(re.fullmatch(r"3 arriving .*: best p50 first token [\d.]+ ms = [\d.]+x alone "
                            r"\(prompts read in groups of \[[\d, ]+\]\)", line)
               for line in lines[1:])
