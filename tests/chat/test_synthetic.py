"""The synthetic instruction set: seeded, held-out items disjoint, answers exact, toy characters."""

import json

from minigpt.chat.synthetic import generate, main, score_by_task, task_of, worked_sum

# the character vocabulary of data=shakespeare_char (its prepared meta.json)
SHAKESPEARE_CHARS = set("\n !\"$&'(),-.0123456789:;?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]"
                        "abcdefghijklmnopqrstuvwxyz—")


def read(path):
    return [json.loads(line)["messages"] for line in path.read_text().splitlines()]


def test_generate_is_seeded_disjoint_and_exact(tmp_path):
    generate(tmp_path / "a", n_train=400, n_val=40, seed=3)
    generate(tmp_path / "b", n_train=400, n_val=40, seed=3)
    assert (tmp_path / "a" / "train.jsonl").read_bytes() == (tmp_path / "b" / "train.jsonl").read_bytes()
    train, val = read(tmp_path / "a" / "train.jsonl"), read(tmp_path / "a" / "val.jsonl")
    assert (len(train), len(val)) == (400, 40)
    assert not {m[0]["content"] for m in train} & {m[0]["content"] for m in val}
    for user, assistant in train + val:
        prompt, answer = user["content"], assistant["content"]
        assert set(prompt + answer) <= SHAKESPEARE_CHARS
        task = task_of(prompt)
        if task == "reverse":
            assert answer == prompt.split(": ")[1][::-1]
        elif task == "add":
            a, b = prompt.removeprefix("What is ").removesuffix("?").split(" plus ")
            assert answer.endswith(f", so {int(a) + int(b)}") and len(a) == len(b) == 2
        elif task == "sentence":
            assert f" {answer} " in prompt.split(".")[0]
        else:
            assert task == "first_letter" and answer == prompt.split()[-1][0]
    assert {task_of(m[0]["content"]) for m in val} == {"reverse", "add", "sentence",
                                                       "first_letter"}


def test_cli_writes_both_files(tmp_path, capsys):
    main(["--out", str(tmp_path), "--train", "20", "--val", "8"])
    assert "wrote 20 training and 8 held-out" in capsys.readouterr().out
    assert len(read(tmp_path / "val.jsonl")) == 8


def test_score_by_task_reads_generate_output(tmp_path):
    generate(tmp_path, n_train=8, n_val=8, seed=0)
    val = read(tmp_path / "val.jsonl")
    replies = tmp_path / "replies.jsonl"
    replies.write_text("".join(json.dumps({"reply": m[1]["content"] if i % 2 else "nope",
                                           "reference": m[1]["content"]}) + "\n"
                               for i, m in enumerate(val)))
    scores = score_by_task(tmp_path / "val.jsonl", replies)
    assert scores["all"] == (4, 8)
    assert sum(n for task, (_, n) in scores.items() if task != "all") == 8


def test_worked_sum_says_each_column_and_the_carry():
    assert worked_sum(46, 19) == "6 plus 9 is 15, 4 plus 1 plus 1 is 6, so 65"
    assert worked_sum(42, 31) == "2 plus 1 is 3, 4 plus 3 is 7, so 73"
    assert worked_sum(99, 99) == "9 plus 9 is 18, 9 plus 9 plus 1 is 19, so 198"
    assert worked_sum(10, 90) == "0 plus 0 is 0, 1 plus 9 is 10, so 100"
