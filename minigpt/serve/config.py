"""``configs/serve.yaml``'s schema and value rules (``python -m minigpt.serve``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minigpt.devices import DTYPES
from minigpt.field_rules import OneOf, Range, Satisfies
from minigpt.paths import INPUT_DIR, INPUT_FILE_OR_DIR, NO_MODEL, no_model_given, path_field

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass
class ServeSchema:
    """``configs/serve.yaml``: what is served, where, and the limits every request meets."""

    ckpt_path: str | None = path_field(INPUT_FILE_OR_DIR)  # a .ckpt file; null: the newest
    # last.ckpt under checkpoints_root
    checkpoints_root: str = path_field(INPUT_DIR, "outputs", when=no_model_given,
                                       missing=NO_MODEL)
    pretrained: str | None = path_field(INPUT_DIR, hub_name=True)  # a Hugging Face GPT-2
    # directory instead of a checkpoint
    model_name: str | None = None  # the id /v1/models lists; null: the checkpoint's file name
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # null: MINIGPT_API_KEY, else no key (loopback only)
    device: str = "auto"
    dtype: str = "auto"
    cpu_speedups: Any = "auto"  # generate.py's CPU weight layouts (minigpt.cpu); false: plain
    cuda_graph_rows: int | None = None  # on a GPU, steps of up to this many rows replay CUDA
    # graphs; null: every batch up to max_batch; 0: none
    engine_process: Any = "auto"  # decode in a process of its own (false: in a thread of the
    # server's process; auto: a process on a GPU, a thread on the CPU)
    max_batch: int = 16  # requests decoded together
    max_queue: int = 64  # requests waiting for a row; more get 429
    max_tokens: int = 4096  # the most new tokens one request may ask for
    max_body_bytes: int = 1_000_000  # a larger request body gets 413
    stream_interval: float = 0.02  # seconds between a stream's events (the first and last: at once)
    shutdown_timeout: float = 10.0  # seconds SIGTERM waits for requests in flight
    log_level: str = "info"  # uvicorn's: critical | error | warning | info | debug


AT_LEAST_1 = Range(1)
SERVE_RULES = {
    "port": Range(0, 65535), "max_batch": AT_LEAST_1, "max_queue": AT_LEAST_1,
    "max_tokens": AT_LEAST_1, "max_body_bytes": Range(1024), "shutdown_timeout": Range(0),
    "stream_interval": Range(0, 10),
    "dtype": OneOf(DTYPES), "cpu_speedups": OneOf(("auto", False)),
    "engine_process": OneOf(("auto", True, False)),
    "cuda_graph_rows": Range(0),
    "log_level": OneOf(("critical", "error", "warning", "info", "debug")),
    "host": Satisfies(lambda h: isinstance(h, str) and bool(h.strip()),
                      "an address to bind, e.g. 127.0.0.1 or 0.0.0.0"),
    "model_name": Satisfies(lambda n: n is None or isinstance(n, str) and bool(n.strip()),
                            "a name, or null for the checkpoint's file name"),
}


def register_serve_schema() -> None:
    """Store the schema in Hydra's ``ConfigStore`` as ``serve_schema`` (configs/serve.yaml)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="serve_schema", node=ServeSchema)


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")
