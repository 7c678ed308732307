"""minigpt.files and minigpt.errors: whole files or none, one-line error text."""

import errno
import os
import shutil
import stat

import pytest
from fault_helpers import small_tmpfs

from minigpt.errors import first_line
from minigpt.files import (
    SNIFF_BYTES,
    DiskFullError,
    TextFileError,
    atomic_write,
    refuse_binary,
    text_lines,
)


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


def test_atomic_write_makes_files_with_the_users_umask(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "shared.json", lambda tmp: tmp.write_text("{}"))
        os.umask(0o077)
        atomic_write(tmp_path / "private.json", lambda tmp: tmp.write_text("{}"))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "shared.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "private.json").stat().st_mode) == 0o600


def test_the_temporary_file_is_beside_the_target(tmp_path):
    (tmp_path / "out").mkdir()
    seen = []
    atomic_write(tmp_path / "out" / "a.txt", lambda tmp: seen.append(tmp) or tmp.write_text("x"))
    assert seen[0].parent == tmp_path / "out" and seen[0].name.startswith(".a.txt.")


def _partly_then_enospc(tmp):
    with open(tmp, "w") as f:
        f.write("partial" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_keeps_the_old_file_and_says_so_in_one_line(tmp_path):
    target = tmp_path / "results.json"
    target.write_text("old")
    with pytest.raises(DiskFullError) as error:
        atomic_write(target, _partly_then_enospc)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{target}: no space left on the device")
    assert "700 bytes written before it filled" in message
    assert "free disk space there or write to another directory" in message
    assert "the previous results.json is unchanged" in message
    assert isinstance(error.value, OSError) and error.value.errno == errno.ENOSPC
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_a_full_disk_found_by_fsync_leaves_no_temporary(tmp_path, monkeypatch):
    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)  # network filesystems report it only here
    with pytest.raises(DiskFullError, match="new.txt: no space left"):
        atomic_write(tmp_path / "new.txt", lambda tmp: tmp.write_text("data"))
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def small_disk(tmp_path):
    with small_tmpfs(tmp_path / "small") as mount:
        yield mount


@pytest.mark.parametrize("writer", ["text", "torch", "safetensors"])
def test_a_real_full_disk_keeps_the_old_file(small_disk, writer):
    import torch
    from safetensors.torch import save_file

    big = torch.zeros(400_000)  # 1.6 MB: more than the whole disk
    write = {"text": lambda tmp: tmp.write_text("x" * 2_000_000),
             "torch": lambda tmp: torch.save({"w": big}, tmp),
             "safetensors": lambda tmp: save_file({"w": big}, tmp)}[writer]
    target = small_disk / "model.bin"
    atomic_write(target, lambda tmp: tmp.write_bytes(b"previous"))
    with pytest.raises(DiskFullError, match=f"{target}: no space left on the device"):
        atomic_write(target, write)
    assert target.read_bytes() == b"previous"
    assert [p.name for p in small_disk.iterdir()] == ["model.bin"]
    assert shutil.disk_usage(small_disk).free > 900_000  # the partial file's room given back


def test_text_lines_name_the_line_of_binary_or_undecodable_content(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"one\r\ntwo\n")
    assert list(text_lines(path)) == [(1, "one\r\n"), (2, "two\n")]
    path.write_bytes(b"one\ntwo\nthree \xff\n")
    with pytest.raises(TextFileError, match=r"a.txt:3: byte 0xff at column 7 is not utf-8 text"):
        list(text_lines(path))
    path.write_bytes(b"one\n\x89PNG\x00\x00\x00\rIHDR")
    with pytest.raises(TextFileError, match=r"a.txt:2: binary content \(a NUL byte\), not text"):
        list(text_lines(path))
    path.write_bytes(b"x" * SNIFF_BYTES + b"\nlate \x00 byte\n")  # past the sniffed head
    with pytest.raises(TextFileError, match=r"a.txt:2: binary content"):
        list(text_lines(path))
    path.write_bytes("utf-16 text\nline two\n".encode("utf-16"))  # a BOM, and NUL bytes
    refuse_binary(path)
    assert [line for _, line in text_lines(path, "utf-16")] == ["utf-16 text\n", "line two\n"]
    with pytest.raises(TextFileError, match=r"a.txt:1: byte 0xff at column 1 is not utf-8"):
        list(text_lines(path))
