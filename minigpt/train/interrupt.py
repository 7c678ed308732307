"""Ctrl-C and SIGTERM: finish the step, save ``last.ckpt``, exit 130 / 143; several processes
agree at each step boundary (over a CPU-side gloo group) and stop at the same step. A second
Ctrl-C ends the process at once, even inside a long native call such as a backward pass (a
watcher thread hears it through ``signal.set_wakeup_fd``), leaving the last complete checkpoint
as it was."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist
from lightning.fabric.utilities import rank_zero_info

EXIT_CODES = {"Ctrl-C": 130, "SIGTERM": 143}


class StopRequest:
    """The signal handlers of one training loop; ``requested()`` at each step boundary."""

    def __init__(self, world_size: int = 1):
        self.signal_name: str | None = None
        self._world_size = world_size
        self._group = None

    @contextlib.contextmanager
    def installed(self):
        """Handle SIGINT and SIGTERM inside the block; the previous handlers after it."""
        if self._world_size > 1 and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")  # collective: every rank creates it
        try:
            previous = {s: signal.signal(s, self._on_signal)
                        for s in (signal.SIGINT, signal.SIGTERM)}
        except ValueError:  # not the main thread (a notebook worker): keep the defaults
            previous = {}
        watcher = InterruptWatcher(self._first_ctrl_c) if previous else None
        try:
            yield self
        finally:
            if watcher is not None:
                watcher.close()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _first_ctrl_c(self) -> None:
        """The watcher thread's news of a first Ctrl-C, before the main thread can act on it."""
        if self.signal_name != "Ctrl-C":
            self.signal_name = "Ctrl-C"
            rank_zero_info("\nCtrl-C: saving a checkpoint after this step (Ctrl-C again to abort)")

    def _on_signal(self, signum, frame):
        if signum == signal.SIGINT:
            self._first_ctrl_c()
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # the next one: the OS ends the process
        else:
            self.signal_name = self.signal_name or "SIGTERM"

    def requested(self) -> bool:
        """Whether any process was asked to stop (the same answer on every process)."""
        if self._group is None:
            return self.signal_name is not None
        code = {None: 0, "SIGTERM": 1, "Ctrl-C": 2}[self.signal_name]
        flag = torch.tensor([code])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        self.signal_name = {0: None, 1: "SIGTERM", 2: "Ctrl-C"}[int(flag[0])]
        return self.signal_name is not None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.signal_name or "SIGTERM"]


ABORTED = (b"\nCtrl-C again: stopped at once; the last complete checkpoint is as it was (resume "
           b"from it with ckpt_path=)\n")


class InterruptWatcher:
    """A thread told of every signal as it arrives (``signal.set_wakeup_fd``, even during a
    native call): ``on_first`` at the first SIGINT, exit 130 at the second. Made in the main
    thread with a Python SIGINT handler; ``close()`` gives the wakeup fd back."""

    def __init__(self, on_first):
        global _fork_hook
        if not _fork_hook:
            os.register_at_fork(after_in_child=_forget_in_child)
            _fork_hook = True
        self._on_first = on_first
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # set_wakeup_fd needs it: a signal never blocks
        self._previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        _watched.append(self)
        self._thread = threading.Thread(target=self._watch, name="second-ctrl-c", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        interrupts = 0
        while True:
            for signum in os.read(self._read, 64):
                if signum == _CLOSE:
                    return
                if signum != signal.SIGINT:
                    continue
                interrupts += 1
                if interrupts == 1:
                    self._on_first()
                else:
                    os.write(sys.stderr.fileno(), ABORTED)
                    os._exit(EXIT_CODES["Ctrl-C"])

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous)
        _watched.remove(self)
        os.set_blocking(self._write, True)
        os.write(self._write, bytes([_CLOSE]))
        self._thread.join()
        os.close(self._write)
        os.close(self._read)


_CLOSE = 0  # no signal has number 0
_watched: list[InterruptWatcher] = []
_fork_hook = False


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker gets the same Ctrl-C) must not count as a second."""
    if _watched:
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(-1)
        for watcher in _watched:
            os.close(watcher._read)
            os.close(watcher._write)
        _watched.clear()
