"""Child functions for ``EngineProcess`` whose decode steps are slower or fail (their own
module, which imports nothing of the tests: the engine's process imports it by name)."""

import time

from minigpt.serve.batch import RunningBatch
from minigpt.serve.process import engine_main

STEP_DELAY_S = 0.01


def slow_engine_main(load, settings, conn):
    """``engine_main`` with every decode step ``STEP_DELAY_S`` longer: a request stays in the
    batch long enough to be cancelled or to fill it."""
    step = RunningBatch.step

    def slow(self, tokens):
        time.sleep(STEP_DELAY_S)
        return step(self, tokens)

    RunningBatch.step = slow
    engine_main(load, settings, conn)


class StepFailure(RuntimeError):
    pass


def failing_step(after: int):
    """A ``RunningBatch.step`` that raises ``StepFailure`` from its ``after``-th call on."""
    step, calls = RunningBatch.step, []

    def fail(self, tokens):
        calls.append(1)
        if len(calls) >= after:
            raise StepFailure("a decode step failed")
        time.sleep(STEP_DELAY_S)
        return step(self, tokens)

    return fail


def failing_engine_main(load, settings, conn):
    """``engine_main`` whose third decode step raises."""
    RunningBatch.step = failing_step(3)
    engine_main(load, settings, conn)
