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
