"""Ctrl-C and SIGTERM: finish the step, save ``last.ckpt``, exit 130 / 143. A second Ctrl-C
exits at once, leaving the last complete checkpoint as it was.

Schedulers (SLURM, Kubernetes, torchrun) send SIGTERM to every process; a terminal sends Ctrl-C
to every process of the foreground group. The processes may notice it at different steps, so
under several processes they agree at each step boundary, over a small CPU-side (gloo) group
that never waits on the GPU, and all stop at the same step."""

from __future__ import annotations

import contextlib
import signal

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
            previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        except ValueError:  # not the main thread (a notebook worker): keep the defaults
            previous = {}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_signal(self, signum, frame):
        if signum == signal.SIGINT:
            self.signal_name = "Ctrl-C"
            rank_zero_info("\nCtrl-C: saving a checkpoint after this step (Ctrl-C again to abort)")
            signal.signal(signal.SIGINT, signal.default_int_handler)
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
