"""The engine: one thread owns the model and decodes every running sequence together.

Continuous batching (Orca, OSDI 2022): the batch is scheduled per step. Between two steps the
engine drops the sequences that finished or were cancelled, reads the prompts that arrived
(``RunningBatch.prefill``/``join``; each new sequence samples its first token from its own
prefill) and then advances every running row by one token in one forward pass
(``RunningBatch.step``). Requests wait in a bounded queue when ``max_batch`` rows run;
``submit`` refuses more than ``max_queue`` waiting (``QueueFull``: the server's 429).

Sampling is per row: greedy rows take the argmax of their allowed tokens; a sampling row draws
with its own seeded generator (``minigpt.sampling.sample_next``), so neither depends on the
other rows. Logprobs are the model's, over its whole vocabulary, as scoring computes them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minigpt.sampling import sample_next
from minigpt.serve.batch import RunningBatch
from minigpt.serve.sequence import Sequence, TokenLogprob, token_logprobs

MAX_ADMISSIONS_IN_A_ROW = 8  # rounds that read new prompts before the running rows step
# Prompt tokens read in one forward pass (a longer prompt is read alone). A CPU's pass costs
# about its tokens' arithmetic, so a burst's median first token comes soonest when about half
# the burst shares a pass (bench.serve_floor); a GPU reads many rows for the price of one.
CPU_PREFILL_TOKENS, GPU_PREFILL_TOKENS = 256, 4096


@dataclass
class EngineStats:
    """Counts since start-up (``GET /metrics`` serves them). The seconds are the engine thread's
    wall time in each part of its rounds: reading prompts (their first tokens and joins
    included), the decode steps' forward passes and their sampling. On a GPU a forward's time
    is the host's (launching it, or replaying its graph); the device's shows in the sampling,
    whose read of the chosen tokens waits for it."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_step_rows: int = 0  # rows summed over the steps: the mean batch is this / steps
    largest_batch: int = 0  # the most rows one step decoded
    cancelled: int = 0  # sequences dropped because their client went away
    prefill_seconds: float = 0.0
    decode_forward_seconds: float = 0.0
    decode_sampling_seconds: float = 0.0


class QueueFull(Exception):
    """More sequences wait than the engine's ``max_queue``."""


class Engine:
    """Decodes ``Sequence`` objects of ``model`` (placed, in eval mode) in one background
    thread: ``start``, ``submit``, ``stop``. ``capacity``: the tokens a row may hold (the
    context); ``prefill_tokens``: the most prompt tokens read in one forward pass (None: the
    device's default); ``graph_rows``: steps of at most that many rows run on fixed shapes
    over the batch's cache (``minigpt.serve.graphs``), replayed from CUDA graphs on a GPU,
    eagerly elsewhere (0: none)."""

    def __init__(self, model, *, max_batch: int = 16, max_queue: int = 64,
                 capacity: int | None = None, prefill_tokens: int | None = None,
                 graph_rows: int = 0):
        self.model, self.max_batch, self.max_queue = model, max_batch, max_queue
        on_gpu = model.tok_emb.weight.device.type == "cuda"
        self.prefill_tokens = prefill_tokens or (GPU_PREFILL_TOKENS if on_gpu else
                                                 CPU_PREFILL_TOKENS)
        self.batch = RunningBatch(model, capacity or model.kv_cache_capacity(), max_batch,
                                  graph_rows=graph_rows, capture=on_gpu)
        self.waiting: deque[Sequence] = deque()
        self.stats = EngineStats()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._joining: list[Sequence] = []  # popped from the queue, not in the batch yet
        self._admissions_in_a_row = 0
        self.error: BaseException | None = None
        # called by the engine thread after each part of a round that may call the sequences'
        # sinks (drops, prompts, the step) and at its end (``minigpt.serve.process`` sends
        # their events from it)
        self.after_events: Callable[[], None] | None = None

    @property
    def running(self) -> int:
        """Sequences in the batch that have not finished (a finished one leaves next round)."""
        return sum(not s.finished for s in self.batch.owners)

    def counts(self) -> dict[str, float]:
        """``running``, ``waiting`` and the ``EngineStats`` (``GET /health``, ``/metrics``)."""
        return {"running": self.running, "waiting": len(self.waiting), **vars(self.stats)}

    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._run, name="minigpt-engine", daemon=True)
        self._thread.start()
        return self

    def submit(self, sequences: list[Sequence]) -> None:
        """Queue ``sequences`` (all or none); ``QueueFull`` when the queue has no room."""
        with self._wake:
            if self._stopping or self.error is not None:
                raise RuntimeError("the engine is stopped")
            if len(self.waiting) + len(sequences) > self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting (max_queue="
                                f"{self.max_queue})")
            self.waiting.extend(sequences)
            self._wake.notify()

    @staticmethod
    def cancel(sequences: list[Sequence]) -> None:
        """Called by the consumer: the unfinished ``sequences`` leave at the next round."""
        for sequence in sequences:
            if not sequence.finished:
                sequence.cancel()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything still queued or running and end the thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while self._next_round():
                    pass
        except BaseException as e:  # a bug: every request learns of it instead of hanging
            self.error = e
            raise
        finally:
            for sequence in [*self.batch.owners, *self._joining, *self.waiting]:
                sequence.abort("cancelled" if self.error is None else "error")
            self.batch.keep([])
            self.waiting.clear()
            self._events_out()

    def _next_round(self) -> bool:
        """One round: wait for work, drop what left, admit what arrived, take a step. Returns
        False once stopped."""
        self._drop_finished()
        self._events_out()  # the ends of sequences dropped, before waiting for work
        with self._wake:
            while not self._stopping and not self.waiting and not len(self.batch):
                self._wake.wait()
            if self._stopping:
                return False
            self._joining = joining = []
            tokens = 0
            while self.waiting and len(self.batch) + len(joining) < self.max_batch and \
                    (not joining or tokens + len(self.waiting[0].prompt) <= self.prefill_tokens):
                sequence = self.waiting.popleft()
                tokens += len(sequence.prompt)
                if not sequence.cancelled:
                    joining.append(sequence)
                else:
                    self._drop(sequence)
        if joining:  # counts before the work: a client may read them once its last token is out
            self.stats.prompt_tokens += sum(len(s.prompt) for s in joining)
            start = time.perf_counter()
            self._admit(joining)
            self.stats.prefill_seconds += time.perf_counter() - start
            self._events_out()  # first tokens go out before anyone's step
        self._joining = []
        # Prompts first: requests that arrived while this one was read join before the next
        # step (their first token waits for no one's step), a few rounds at most
        if joining and self.waiting and len(self.batch) < self.max_batch \
                and self._admissions_in_a_row < MAX_ADMISSIONS_IN_A_ROW:
            self._admissions_in_a_row += 1
            return True
        self._admissions_in_a_row = 0
        if len(self.batch):
            self._step()
        self._events_out()
        return True

    def _events_out(self) -> None:
        if self.after_events is not None:
            self.after_events()

    def _drop_finished(self) -> None:
        for sequence in self.batch.owners:
            if sequence.cancelled and not sequence.finished:
                self._drop(sequence)
        self.batch.keep([r for r, s in enumerate(self.batch.owners) if not s.finished])

    def _drop(self, sequence: Sequence) -> None:
        sequence.abort()
        self.stats.cancelled += 1

    def _admit(self, joining: list[Sequence]) -> None:
        """Read the new prompts (scored ones alone, at every position), sample each one's first
        token and add the unfinished ones to the batch."""
        scored = [s for s in joining if s.params.echo and s.params.logprobs is not None]
        plain = [s for s in joining if s not in scored]
        for group, all_positions in [*(([s], True) for s in scored), (plain, False)]:
            if not group:
                continue
            logits, cache = self.batch.prefill([s.prompt for s in group],
                                               all_positions=all_positions)
            if all_positions:
                sequence = group[0]
                sequence.start(self._prompt_logprobs(sequence, logits[0]))
                logits = logits[:, -1]
            else:
                for sequence in group:
                    sequence.start(None)
            self._sample(group, logits)
            rows = [r for r, s in enumerate(group) if not s.finished]
            if rows:
                self.batch.join(cache.rows(torch.tensor(rows, device=logits.device))
                                if len(rows) < len(group) else cache, [group[r] for r in rows])

    def _step(self) -> None:
        owners, stats = self.batch.owners, self.stats
        start = time.perf_counter()
        device = self.batch.cache.seen.device
        tokens = torch.tensor([[s.tokens[-1]] for s in owners], device=device)  # (B, 1)
        logits = self.batch.step(tokens)
        stepped = time.perf_counter()
        stats.decode_forward_seconds += stepped - start
        stats.decode_steps += 1
        stats.decode_step_rows += len(owners)
        stats.largest_batch = max(stats.largest_batch, len(owners))
        self._sample(owners, logits)
        stats.decode_sampling_seconds += time.perf_counter() - stepped

    def _sample(self, sequences: list[Sequence], logits: torch.Tensor) -> None:
        """Each unfinished sequence's next token from its row of ``logits`` (B, V)."""
        live = [r for r, s in enumerate(sequences) if not s.finished]
        if not live:
            return
        allowed = sequences[live[0]].allowed  # (V,): one mask for all rows, usually
        if any(sequences[r].allowed is not allowed for r in live):
            allowed = torch.stack([sequences[r].allowed for r in live])  # (R, V)
        rows = (logits if len(live) == len(sequences) else logits[live]).float()
        masked = rows + allowed
        chosen = masked.argmax(dim=-1)  # (R,)
        for i, r in enumerate(live):
            sequence = sequences[r]
            if not sequence.greedy:
                p = sequence.params
                chosen[i] = sample_next(masked[i:i + 1], p.temperature, p.top_k, p.top_p,
                                        sequence.generator)[0]
        wanted = [i for i, r in enumerate(live) if sequences[r].params.logprobs is not None]
        scores = dict(zip(wanted, self._logprobs([sequences[live[i]] for i in wanted],
                                                 rows[wanted], chosen[wanted]), strict=True)) \
            if wanted else {}
        self.stats.generated_tokens += len(live)
        for i, token in enumerate(chosen.tolist()):
            sequences[live[i]].accept(token, scores.get(i))

    @staticmethod
    def _logprobs(sequences: list[Sequence], logits, chosen) -> list[TokenLogprob]:
        top = max(s.params.logprobs for s in sequences)
        out = token_logprobs(logits, chosen, top, sequences[0].decode)
        for sequence, entry in zip(sequences, out, strict=True):
            keep = sequence.params.logprobs
            entry.top = dict(list(entry.top.items())[:keep]) if entry.top else {}
        return out

    @staticmethod
    def _prompt_logprobs(sequence: Sequence, logits: torch.Tensor) -> list[TokenLogprob]:
        """The prompt's tokens scored by the logits before each (T, V): the first has none."""
        prompt = torch.tensor(sequence.prompt, device=logits.device)
        first = TokenLogprob(sequence.decode(sequence.prompt[:1]), None, None)
        if len(sequence.prompt) == 1:
            return [first]
        rest = token_logprobs(logits[:-1], prompt[1:], sequence.params.logprobs,
                              sequence.decode)
        return [first, *rest]
