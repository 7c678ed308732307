"""minigpt.checkpoint.write: files written whole or not at all, ``last`` linked to ``best`` when
they hold the same state, leftovers of a killed run removed."""

import os

import pytest
import torch
from lightning.fabric import Fabric

from minigpt.checkpoint.write import CheckpointFiles


@pytest.fixture
def files(tmp_path):
    return CheckpointFiles(Fabric(accelerator="cpu", devices=1), tmp_path / "checkpoints")


def test_a_write_is_whole_or_not_at_all(files, monkeypatch):
    path = files.write("last.ckpt", {"step": 1})
    assert torch.load(path, weights_only=True) == {"step": 1}

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        files.write("last.ckpt", {"step": 2})
    assert torch.load(path, weights_only=True) == {"step": 1}
    # the half-written temporary file is hidden, and the next run removes it
    leftovers = [p.name for p in files.directory.iterdir() if p.name != "last.ckpt"]
    assert all(name.startswith(".") and name.endswith(".tmp") for name in leftovers)
    files.remove_leftovers()
    assert [p.name for p in files.directory.iterdir()] == ["last.ckpt"]


def test_last_links_to_best_and_a_later_write_replaces_the_link(files):
    files.write("best.ckpt", {"step": 1})
    files.link_last_to_best()
    last = files.directory / "last.ckpt"
    assert last.is_symlink() and os.readlink(last) == "best.ckpt"
    files.write("last.ckpt", {"step": 2})  # replaces the link, never writes through it
    assert not last.is_symlink()
    assert torch.load(files.directory / "best.ckpt", weights_only=True) == {"step": 1}
    assert torch.load(last, weights_only=True) == {"step": 2}


def test_a_directory_of_shards_replaces_a_file_and_the_reverse(files, tmp_path):
    from minigpt.checkpoint.write import _replace

    shards = tmp_path / "new"
    shards.mkdir()
    (shards / "meta.pt").write_bytes(b"x")
    target = files.write("last.ckpt", {"step": 1})
    _replace(shards, target)
    assert (target / "meta.pt").read_bytes() == b"x"
    again = tmp_path / "again"
    again.mkdir()
    _replace(again, target)  # a directory over a directory: the old one is gone
    assert target.is_dir() and not list(target.iterdir())
    assert not [p for p in files.directory.iterdir() if p.name.startswith(".")]
