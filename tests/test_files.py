"""minigpt.files and minigpt.errors: whole files or none, one-line error text."""

import pytest

from minigpt.errors import first_line
from minigpt.files import atomic_write


def test_atomic_write_replaces_the_target_whole(tmp_path):
    target = tmp_path / "meta.json"
    atomic_write(target, lambda tmp: tmp.write_text("new"))
    assert target.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["meta.json"]


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, error):
    target = tmp_path / "model.safetensors"
    target.write_text("old")

    def half_then_fail(tmp):
        tmp.write_text("half")
        raise error

    with pytest.raises(type(error)):
        atomic_write(target, half_then_fail)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_first_line_names_the_type_and_cuts_long_messages():
    assert first_line(ValueError("bad value\nsecond line")) == "ValueError: bad value"
    assert first_line(OSError()) == "OSError"
    assert first_line(ValueError("x" * 300), limit=10) == "ValueError: xxxxxxx..."
    try:
        try:
            raise OSError("no route to host")
        except OSError as inner:
            raise RuntimeError("download failed") from inner
    except RuntimeError as outer:
        assert first_line(outer) == "RuntimeError: download failed"
        assert first_line(outer, root_cause=True) == "OSError: no route to host"
