"""Loading the served model and running uvicorn: ``run(settings)`` is ``python -m minigpt.serve``.

The model is read by ``minigpt.inference.load_for_inference`` (generate.py's loader: a
checkpoint's weights are data, never code; ``device``/``dtype`` as generate.py reads them) and
placed as generate.py places its eager decoder. Uvicorn serves until SIGTERM or Ctrl-C: it stops
accepting, lets the requests in flight finish for ``shutdown_timeout`` seconds, cancels the rest,
and the process exits 0.

On a GPU the engine's decode steps of up to ``cuda_graph_rows`` rows (null: ``max_batch``) replay
CUDA graphs captured at start-up (``minigpt.serve.graphs``); larger batches and prompts run
eagerly.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from pathlib import Path

from minigpt.config import settings_problems
from minigpt.cpu import keep_freed_host_memory
from minigpt.devices import check_device
from minigpt.errors import ConfigError, ResourceError, UserError
from minigpt.paths import check_paths
from minigpt.serve.config import SERVE_RULES, ServeSchema, is_loopback
from minigpt.serve.engine import Engine
from minigpt.serve.process import process_service
from minigpt.serve.service import Service
from minigpt.train.memory import memory_available

API_KEY_ENV = "MINIGPT_API_KEY"
SWITCH_INTERVAL_S = 0.0005
# The share of a device's free memory the batch's KV cache may take: the rest is for the
# activations of a prompt pass and the graphs' memory pool.
KV_CACHE_SHARE = 0.9


def api_key_of(settings: ServeSchema) -> str | None:
    """The key clients must send: ``api_key=``, else ``$MINIGPT_API_KEY``, else none."""
    return settings.api_key or os.environ.get(API_KEY_ENV) or None


def check_settings(settings: ServeSchema) -> None:
    """Every bad value at once, and the refusal to serve beyond loopback without a key."""
    problems = settings_problems(settings, SERVE_RULES)
    if not problems and not is_loopback(settings.host) and api_key_of(settings) is None:
        problems.append(f"host={settings.host} serves beyond this machine, so it needs an API "
                        f"key: set api_key=... or {API_KEY_ENV}, or bind host=127.0.0.1")
    if problems:
        raise ConfigError("; ".join(problems))
    check_paths(settings)  # ckpt_path, pretrained, checkpoints_root: before the model loads


def check_address(host: str, port: int) -> None:
    """``host:port`` can be listened on (tried with a socket opened and closed at once), so that
    an address in use or a host that names no interface answers before the model loads instead
    of in uvicorn's log after it."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as error:
        reason = error.strerror or str(error)
        raise UserError(f"host={host} port={port} cannot be listened on ({reason}): choose "
                        "another port (port=0 takes a free one, printed at start-up), stop what "
                        "listens there, or bind a host of this machine (127.0.0.1)") from None


def graph_rows(settings: ServeSchema, device: str) -> int:
    """The most rows a decode step replays from CUDA graphs on ``device`` (0: none, off a GPU)."""
    if not device.startswith("cuda"):
        return 0
    return settings.max_batch if settings.cuda_graph_rows is None else settings.cuda_graph_rows


def uses_engine_process(settings: ServeSchema) -> bool:
    """Whether the engine decodes in a process of its own (``minigpt.serve.process``): ``auto``
    on a GPU, whose steps must not wait for the server's Python; a CPU's few cores are the
    engine's own, and a second process competes for them."""
    if settings.engine_process == "auto":
        return check_device(settings.device).startswith("cuda")
    return settings.engine_process


def load_service(settings: ServeSchema) -> Service:
    """The model of ``settings`` loaded, placed and wrapped with its engine (not started)."""
    from minigpt.inference import load_for_inference

    check_settings(settings)
    loaded = load_for_inference(settings.ckpt_path, settings.pretrained,
                                settings.checkpoints_root, device=settings.device,
                                dtype=settings.dtype)
    model = loaded.model
    if model.config.window is not None:
        raise UserError(f"{loaded.source} attends with a sliding window (window="
                        f"{model.config.window}): the server's batch cache holds full "
                        "attention only; sample it with generate.py")
    applied = loaded.place(cpu_speedups=settings.cpu_speedups is not False)
    check_cache_fits(model, settings.max_batch, loaded.device)
    if applied and keep_freed_host_memory():  # prompts and steps make and free the same tensors
        applied.append("glibc keeps freed memory")
    engine = Engine(model, max_batch=settings.max_batch, max_queue=settings.max_queue,
                    graph_rows=graph_rows(settings, loaded.device))
    name = settings.model_name or Path(loaded.source).name
    service = Service(model.config, loaded.tokenizer, engine, name=name,
                      template=loaded.chat_template, max_tokens=settings.max_tokens,
                      device=loaded.device)
    _info(f"{loaded.describe()}; cpu speedups: {', '.join(applied) or 'none'}; serving it as "
          f"{name!r} ({'chat template stored' if service.template else 'no chat template'}), "
          f"up to {settings.max_batch} requests at once (a KV cache of "
          f"{engine.batch.cache.nbytes / 2**20:,.0f} MiB){_steps_note(engine)}")
    return service


def check_cache_fits(model, max_batch: int, device: str) -> None:
    """Refuse, before allocating it, a batch KV cache ``device`` has no room for: a GPU would
    fail to allocate it, and a CPU would commit it a row at a time and be killed for it later."""
    tokens = model.kv_cache_capacity()
    row = tokens * model.kv_cache_bytes_per_token()
    available, where = memory_available(device)
    if max_batch * row > available * KV_CACHE_SHARE:
        raise ResourceError(
            f"max_batch={max_batch} needs a KV cache of {max_batch * row / 2**30:,.2f} GiB "
            f"({row / 2**20:,.1f} MiB a row of {tokens} tokens) but {where} "
            f"has {available / 2**30:,.2f} GiB free: lower max_batch (at most "
            f"{int(available * KV_CACHE_SHARE // row)} fit)")


def _steps_note(engine: Engine) -> str:
    steps = engine.batch.fixed_steps
    if steps is None or not steps.graphs:
        return ""
    return (f", decode steps of up to {steps.max_rows} rows from CUDA graphs "
            f"({len(steps.graphs)} captured)")


def run(settings: ServeSchema) -> None:
    """Serve until SIGTERM or Ctrl-C (see the module docstring)."""
    import uvicorn

    from minigpt.serve.app import create_app

    check_settings(settings)
    check_address(settings.host, settings.port)
    service = process_service(settings, load_service) if uses_engine_process(settings) \
        else load_service(settings)
    app = create_app(service, api_key=api_key_of(settings),
                     max_body_bytes=settings.max_body_bytes,
                     stream_interval=settings.stream_interval)
    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            timeout_graceful_shutdown=settings.shutdown_timeout,
                            log_level=settings.log_level, access_log=False)
    server = uvicorn.Server(config)
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again for the handler
    # it found: this one, so that a requested stop exits 0
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    # the engine thread and the event loop hand the interpreter to each other: a shorter
    # switch interval than Python's 5 ms keeps either from waiting long on the other
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    service.engine.start()
    try:
        server.run()
    finally:
        service.engine.stop()
    if service.engine.error is not None:
        raise service.engine.error


class ThreadedServer:
    """``service`` served by uvicorn in a background thread on a free loopback port, for tests
    and benchmarks: ``with serve_in_thread(service) as server: server.url``."""

    def __init__(self, service: Service, *, api_key: str | None = None,
                 max_body_bytes: int = 1_000_000, shutdown_timeout: float = 2.0,
                 stream_interval: float = 0.0):
        import uvicorn

        from minigpt.serve.app import create_app

        self.service = service
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        app = create_app(service, api_key=api_key, max_body_bytes=max_body_bytes,
                         stream_interval=stream_interval)
        self.server = uvicorn.Server(uvicorn.Config(
            app, log_level="warning", access_log=False,
            timeout_graceful_shutdown=shutdown_timeout))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       name="minigpt-uvicorn", daemon=True)

    def __enter__(self) -> ThreadedServer:
        self.service.engine.start()
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the test server failed to start")
            threading.Event().wait(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.service.engine.stop()
        self.socket.close()


serve_in_thread = ThreadedServer


def _info(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
