"""Decode steps made slower or failing, for the server's tests: ``delayed_step`` for one
process, and child functions for ``EngineProcess`` (in their own module, which imports nothing of
the tests: the engine's process imports it by name)."""

import time

from minigpt.serve.batch import RunningBatch
from minigpt.serve.process import engine_main

STEP_DELAY_S = 0.01


class StepFailure(RuntimeError):
    pass


def delayed_step(delay: float = STEP_DELAY_S, fail_after: int | None = None):
    """``RunningBatch.step`` taking ``delay`` seconds more (a request stays in the batch long
    enough to be cancelled or to fill it), raising ``StepFailure`` from its ``fail_after``-th
    call on."""
    step, calls = RunningBatch.step, []

    def delayed(self, tokens):
        calls.append(1)
        if fail_after is not None and len(calls) >= fail_after:
            raise StepFailure("a decode step failed")
        time.sleep(delay)
        return step(self, tokens)

    return delayed


def slow_engine_main(load, settings, conn):
    """``engine_main`` with every decode step ``STEP_DELAY_S`` longer."""
    RunningBatch.step = delayed_step()
    engine_main(load, settings, conn)


def failing_engine_main(load, settings, conn):
    """``engine_main`` whose third decode step raises."""
    RunningBatch.step = delayed_step(fail_after=3)
    engine_main(load, settings, conn)
