"""The engine in a process of its own: ``EngineProcess`` (``engine_process=true``; ``auto``, the
default, on a GPU).

Python runs one thread of a process at a time. An engine thread beside a busy event loop waits
for the interpreter lock after each operation of its forward pass, so a burst of requests to
parse, or many streams to write, slows the decoding of every running row. In a process of its
own the engine holds its own interpreter: the server's process parses, tokenizes, checks and
streams; the engine's process reads prompts and decodes. It pays where the host has cores to
spare (a GPU's host); on a CPU of few cores the two processes compete for them.

The server's ``Service`` builds each request's ``Sequence`` as for an engine in a thread; the
``EngineProcess`` sends what decoding needs (prompt, sampling values, end tokens, index and the
sequence's token mask, each mask once) through a pipe, and the child decodes its own copy of
each sequence (``Engine``, from ``load_service``). The child sends the events of a round's
prompts or step with the engine's counts: at once when one is a sequence's first or last, else
at most every ``stream_interval``. The server's copy gets each event at its ``sink``, and is
marked finished at its last one. Admission is decided in the server's process: a request is
refused (``QueueFull``) when more than ``max_batch + max_queue`` sequences would be unfinished.
"""

from __future__ import annotations

import math
import multiprocessing
import signal
import threading
import time
from dataclasses import replace
from functools import partial
from typing import NamedTuple

from minigpt.serve.engine import EngineStats, QueueFull
from minigpt.serve.sequence import Event, Sequence

STOP_GRACE_S = 5.0  # beyond ``stop``'s timeout, for the child to exit before it is killed


class ModelInfo(NamedTuple):
    """What the server's process needs of the model the child loaded."""

    config: object  # GPTConfig
    tokenizer: object
    template: object  # a ChatTemplate, or None
    name: str


def process_service(settings, load, *, entry=None):
    """The ``Service`` ``load(settings)`` (``minigpt.serve.server.load_service``) makes, its
    engine an ``EngineProcess`` running it (``entry``: the child's function)."""
    from minigpt.serve.service import Service

    engine = EngineProcess(settings, load, entry=entry)
    info = engine.info
    return Service(info.config, info.tokenizer, engine, name=info.name, template=info.template,
                   max_tokens=settings.max_tokens)


class EngineProcess:
    """The ``Engine`` of the ``Service`` that ``load(settings)`` makes (``load_service``, a
    module-level function: the child imports it), decoding in a child process, with the
    part of an ``Engine``'s interface the server uses: ``submit``, ``cancel``, ``counts``,
    ``stop`` and ``error`` (set once the child failed or went away). Construction starts the
    child and waits until its model is loaded (its loading errors are raised here); ``info``
    describes what it loaded (``ModelInfo``).
    ``entry``: the child's function (tests wrap it)."""

    def __init__(self, settings, load, *, entry=None):
        self.max_batch, self.max_queue = settings.max_batch, settings.max_queue
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self._conn, child_conn = context.Pipe()
        self.process = context.Process(target=entry or engine_main, args=(load, settings, child_conn),
                                       name="minigpt-engine", daemon=True)
        self.process.start()
        child_conn.close()
        self.error: BaseException | None = None
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(f"the engine process exited while loading the model (status "
                               f"{self.process.exitcode})") from None
        if kind == "failed":
            self.process.join()
            raise value
        self.info = value
        self._lock = threading.Lock()
        self._live: dict[int, Sequence] = {}  # sent and not finished, by id
        self._next_id = 0
        self._masks: dict[int, tuple[int, object]] = {}  # id(mask) -> (key, mask)
        self._counts = {"running": 0, "waiting": 0, **vars(EngineStats())}
        self._stopping = False
        self._receiver = threading.Thread(target=self._receive, name="minigpt-engine-events",
                                          daemon=True)
        self._receiver.start()

    def start(self) -> EngineProcess:
        return self  # the child's engine runs from the start

    def submit(self, sequences: list[Sequence]) -> None:
        """Send ``sequences`` to the engine (all or none); ``QueueFull`` when no room."""
        with self._lock:
            if self._stopping or self.error is not None:
                raise RuntimeError("the engine is stopped")
            if len(self._live) + len(sequences) > self.max_batch + self.max_queue:
                waiting = len(self._live) - self.max_batch
                raise QueueFull(f"{waiting} requests are waiting (max_queue={self.max_queue})")
            work = []
            for sequence in sequences:
                self._next_id += 1
                self._live[self._next_id] = sequence
                work.append((self._next_id, sequence.prompt, sequence.params,
                             sequence.end_ids, self._mask_key(sequence.allowed), sequence.index))
            self._conn.send(("submit", work))

    def _mask_key(self, mask) -> int:
        """The child's number for ``mask``, sending it the first time (masks are few and live as
        long as the service; the dict keeps each one, so its ``id`` stays its own)."""
        known = self._masks.get(id(mask))
        if known is None:
            known = self._masks[id(mask)] = (len(self._masks), mask)
            self._conn.send(("mask", known[0], mask.cpu()))
        return known[0]

    def cancel(self, sequences: list[Sequence]) -> None:
        """The unfinished ``sequences`` leave the batch at the engine's next round."""
        with self._lock:
            ids = [key for key, live in self._live.items()
                   if not live.finished and any(live is s for s in sequences)]
            if ids and not self._stopping and self.error is None:
                self._conn.send(("cancel", ids))

    def counts(self) -> dict[str, float]:
        """The engine's ``counts()`` as of the last events it sent."""
        return dict(self._counts)

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything queued or running, end the child (killed if it does not exit)."""
        with self._lock:
            self._stopping = True
            try:
                self._conn.send(("stop", timeout))
            except OSError:  # the child is gone already
                pass
        self.process.join(timeout + STOP_GRACE_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._receiver.join(STOP_GRACE_S)

    def _receive(self) -> None:
        """The child's events, to their sequences' sinks, until the child is gone."""
        while True:
            try:
                events, counts, error = self._conn.recv()
            except (EOFError, OSError):
                break
            self._counts = counts
            if error is not None and self.error is None:
                self.error = RuntimeError(f"the engine failed: {error}")
            for key, event in events:
                with self._lock:
                    sequence = self._live.get(key)
                    if event.finish_reason is not None:
                        self._live.pop(key, None)
                if sequence is not None:
                    sequence.finished = event.finish_reason is not None
                    sequence.sink(event)
        self.process.join(STOP_GRACE_S)  # its pipe closed: it is exiting, its status follows
        with self._lock:
            left, self._live = list(self._live.values()), {}
            if not self._stopping and self.error is None:
                self.error = RuntimeError(f"the engine process exited (status "
                                          f"{self.process.exitcode})")
        for sequence in left:  # what the child never finished: as an engine that failed does
            sequence.finished = True
            sequence.sink(Event(sequence.index, finish_reason="cancelled" if self._stopping
                                else "error", prompt_tokens=len(sequence.prompt)))


def engine_main(load, settings, conn) -> None:
    """The child: load the model and its engine (``load(settings)``), report, then decode
    what arrives until told to stop or the server's process goes away."""
    # Ctrl-C and a service manager's SIGTERM reach the whole process group: the server's process
    # shuts down gracefully and then stops this one
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        # the server's process refuses beyond max_batch + max_queue unfinished sequences, so
        # this engine's queue takes them all
        service = load(replace(settings, max_queue=settings.max_batch + settings.max_queue))
    except BaseException as error:  # noqa: BLE001 - the server's process raises it
        try:
            conn.send(("failed", error))
        except Exception:  # noqa: BLE001 - an exception that does not pickle: its text
            conn.send(("failed", RuntimeError(f"{type(error).__name__}: {error}")))
        return
    engine, device = service.engine, service.text_tokens.device
    conn.send(("ready", ModelInfo(service.config, service.tokenizer, service.template,
                                  service.name)))
    live: dict[int, Sequence] = {}
    outbox: list[tuple[int, Event]] = []
    sending = threading.Lock()  # the engine's thread sends events; this one, refusals
    started: set[int] = set()  # sequences that sent an event
    urgent, sent_at = False, -math.inf

    def sink(key: int, event: Event) -> None:  # the engine's thread
        nonlocal urgent
        outbox.append((key, event))
        # a sequence's first event and its last go at once, the others at the stream interval
        urgent = urgent or key not in started or event.finish_reason is not None
        started.add(key)
        if event.finish_reason is not None:
            live.pop(key, None)
            started.discard(key)

    def send_events() -> None:  # the engine's thread (Engine.after_events)
        nonlocal outbox, urgent, sent_at
        if not outbox and engine.error is None:
            return
        now = time.monotonic()
        with sending:
            if not (outbox and (urgent or now - sent_at >= settings.stream_interval)
                    or engine.error is not None):
                return
            events, outbox, urgent, sent_at = outbox, [], False, now
            error = engine.error and f"{type(engine.error).__name__}: {engine.error}"
            try:
                conn.send((events, engine.counts(), error))
            except OSError:  # the server's process is gone: nobody to tell
                pass

    engine.after_events = send_events
    engine.start()
    masks = {}
    while True:
        try:
            kind, *args = conn.recv()
        except (EOFError, OSError):  # the server's process is gone
            kind, args = "stop", [0.0]
        if kind == "mask":
            masks[args[0]] = args[1].to(device)
        elif kind == "submit":
            sequences = []
            for key, prompt, params, end_ids, mask, index in args[0]:
                live[key] = Sequence(prompt, params, end_ids=end_ids, allowed=masks[mask],
                                     decode=service.decode, sink=partial(sink, key), index=index)
                sequences.append(live[key])
            try:
                engine.submit(sequences)
            except RuntimeError:  # the engine stopped (it failed): these end as its others did
                for sequence in sequences:
                    sequence.abort("error")
                send_events()
        elif kind == "cancel":
            engine.cancel([live[key] for key in args[0] if key in live])
        else:  # stop
            engine.stop(args[0])
            break


