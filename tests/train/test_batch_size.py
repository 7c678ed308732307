"""minigpt.train.memory: the memory budget, the memory left in a container, and the search
for the largest micro-batch, tried against a fake step that runs out of memory above a size the
test picks."""

from __future__ import annotations

import math
import weakref

import pytest
import torch

from minigpt.config.rules import parse_memory_budget
from minigpt.errors import ConfigError
from minigpt.train.memory import (
    cgroup_memory_left,
    fits_when_tried,
    largest_divisor_at_most,
    largest_that_fits,
    within_budget,
)


@pytest.mark.parametrize(("value", "size"), [
    (None, None), (1024, 1024), ("8GB", 8 * 10**9), ("12GiB", 12 * 2**30), ("1.5 TB", 15 * 10**11),
    ("512mib", 512 * 2**20), ("640 KB", 640_000), ("300", 300), (" 2 gb ", 2 * 10**9),
])
def test_memory_budget_sizes(value, size):
    assert parse_memory_budget(value) == size


@pytest.mark.parametrize("value", ["8 GBs", "-1GB", "0", 0, -5, "lots", "", True, 1.5, [8]])
def test_bad_memory_budget_is_one_line_naming_it(value):
    with pytest.raises(ConfigError, match=r"^trainer\.memory_budget=.* must be bytes") as error:
        parse_memory_budget(value)
    assert repr(value) in str(error.value) and "\n" not in str(error.value)


def test_within_budget_takes_the_smaller():
    assert within_budget(100, "GPU 0", None) == (100, "GPU 0")
    assert within_budget(100, "GPU 0", 200) == (100, "GPU 0")
    limit, where = within_budget(100, "GPU 0", 40)
    assert limit == 40 and "trainer.memory_budget" in where and "GPU 0" in where


def test_cgroup_memory_left(tmp_path):
    assert cgroup_memory_left(tmp_path) is None  # no control group files: no limit
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("300\n")
    assert cgroup_memory_left(tmp_path) is None
    (tmp_path / "memory.max").write_text("1000\n")
    assert cgroup_memory_left(tmp_path) == 700
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory/memory.limit_in_bytes").write_text(str(2**63 - 4096))  # v1's "no limit"
    (v1 / "memory/memory.usage_in_bytes").write_text("5")
    assert cgroup_memory_left(v1) is None
    (v1 / "memory/memory.limit_in_bytes").write_text("50")
    assert cgroup_memory_left(v1) == 45


class FakeDevice:
    """A device whose training step at size n allocates n blocks and runs out of memory above
    ``capacity``; it records every size tried and checks each try starts from empty memory."""

    def __init__(self, capacity: int):
        self.capacity, self.tried, self.held = capacity, [], []
        self.last_block: weakref.ref | None = None

    def try_size(self, n: int) -> None:
        assert self.held == [], "the previous try's memory was not released"
        self.tried.append(n)
        block = torch.empty(n)
        self.held.append(n)
        self.last_block = weakref.ref(block)
        if n > self.capacity:
            raise torch.OutOfMemoryError(f"tried to allocate {n} blocks")

    def release(self) -> None:
        # The error's traceback (which holds the try's frame and its tensors) is gone by now.
        assert self.last_block() is None, "the failed try's tensors are still alive"
        self.held.clear()


@pytest.mark.parametrize("upper", [1, 2, 7, 16, 33, 100])
def test_search_picks_the_threshold_exactly_and_releases_memory(upper):
    for capacity in range(0, 110):
        device = FakeDevice(capacity)
        found = largest_that_fits(fits_when_tried(device.try_size, device.release), upper)
        assert found == min(capacity, upper), (capacity, upper, device.tried)
        assert device.held == []  # released after the last try too
        assert len(set(device.tried)) == len(device.tried)  # no size tried twice
        assert len(device.tried) <= 2 * math.ceil(math.log2(upper)) + 2
        assert all(1 <= n <= upper for n in device.tried)


def test_a_try_that_says_no_does_not_fit_and_all_processes_agree():
    assert largest_that_fits(fits_when_tried(lambda n: n <= 5), 64) == 5  # e.g. over a budget
    tried = []

    def another_process_fits_only_3(fit: bool) -> bool:
        return fit and tried[-1] <= 3

    assert largest_that_fits(fits_when_tried(tried.append, agree=another_process_fits_only_3),
                             64) == 3


def test_other_errors_are_not_out_of_memory():
    def broken(n):
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        largest_that_fits(fits_when_tried(broken), 8)


@pytest.mark.parametrize(("rows", "limit", "divisor"), [
    (8, 3, 2), (8, 8, 8), (8, 100, 8), (12, 5, 4), (7, 6, 1), (36, 10, 9), (1, 1, 1), (6, 0, 1)])
def test_largest_divisor_at_most(rows, limit, divisor):
    assert largest_divisor_at_most(rows, limit) == divisor


def test_measured_limit_keeps_a_share_free_unless_the_budget_is_smaller():
    from minigpt.train.plan import MEASURED_SHARE, measured_limit

    usable = 80 * 2**30
    limit, words = measured_limit(usable, "cuda:0 (H100)", None)
    assert limit == int(usable * MEASURED_SHARE) < usable
    assert "cuda:0 (H100)" in words and "80.00 GiB" in words
    assert measured_limit(usable, "cuda:0", 20 * 2**30) == (20 * 2**30, "trainer.memory_budget (20.00 GiB)")
    assert measured_limit(usable, "cuda:0", usable)[0] == limit  # a budget above the share
