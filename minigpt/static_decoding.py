"""Fixed-shape decoding: ``GPT.forward`` on one token per row, over a KV cache whose shapes never
change, compiled once and reused for every token: on a GPU with
``torch.compile(mode="reduce-overhead")``, captured once as a CUDA graph and replayed; on the CPU
by inductor's C++ backend (one fused program per step instead of ~200 eager ops).

Why: at batch 1 a GPT-2-small decode step is ~200 small kernels. The eager decoder attends over
the filled part of its cache, which grows by one token per step, so every step has new shapes
and Python launches each kernel: the GPU mostly waits. A cache built with ``sliced=False``
(``minigpt.kv_cache``) makes a one-token step attend over its whole capacity under the mask of
the filled slots, and keeps the token count in a device tensor, so one captured graph serves
every step. The model, its forward and the cache are the ones the eager decoder uses; only the
cache's property differs.

Every step attends over the cache's whole capacity, so a cache sized to the generation
(``capacity``: prompt + new tokens, rounded up to ``CAPACITY_MULTIPLE``) reads only what the
generation needs, not the model's full context.

``generate(..., decoder=StaticDecoder(model, B, compile=True))`` fills ``decoder.cache`` from the
prompt with the eager model (and refills it after a crop), then calls ``step`` once per token.

Shape letters: B batch, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["StaticDecoder", "cpu_step_options"]

# Capacities are rounded up to a multiple of this: nearby lengths share one compiled step.
CAPACITY_MULTIPLE = 64


def cpu_step_options() -> dict:
    """Inductor's options for the compiled CPU step. ``deterministic``, where this torch has it,
    keeps a broadcast input a stored buffer: without it inductor recomputes the row a linear
    layer reads (a LayerNorm of the residual stream) inside the loop over every weight row,
    which makes a one-row product of ``minigpt.cpu``'s row-sum layout compute-bound
    (bench/README.md). No ``size_asserts``: dynamo's guards already check every input's sizes
    and strides, and the wrapper's Python checks cost ~0.1 ms a step."""
    import torch._inductor.config as inductor_config

    options = {"size_asserts": False}
    if hasattr(inductor_config, "deterministic"):
        options["deterministic"] = True
    return options


class StaticDecoder:
    """A fixed-shape KV cache of ``model`` for ``batch_size`` rows, and its one-token step.

    ``capacity``: the most tokens a generation holds (prompt + new tokens; rounded up to
    ``CAPACITY_MULTIPLE``, at most what ``model.new_kv_cache`` holds by default, its context or
    window); None: that default. ``generate`` refuses a decoder too small for its call. With
    ``compile`` the step (``model`` itself) is compiled: with ``mode="reduce-overhead"`` (CUDA
    graphs) on a GPU, by inductor on the CPU; without it, it runs eagerly, as the reference the
    tests compare both with. Build one per batch size and reuse it: each new decoder compiles
    its step again.
    """

    def __init__(self, model, batch_size: int, *, compile: bool = False,
                 capacity: int | None = None):
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                     or capacity < 1):
            raise ValueError(f"capacity={capacity!r} must be a positive number of tokens")
        self.model, self.batch_size, self.compiled = model, batch_size, compile
        full = model.kv_cache_capacity()
        slots = full if capacity is None else \
            min(full, -(-capacity // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE)
        self.cache = model.new_kv_cache(batch_size, slots, sliced=False)
        self.token = torch.zeros(batch_size, 1, dtype=torch.long,
                                 device=self.cache.seen.device)
        # The graph reads and writes these in place: fixed addresses, no copies, no guards.
        for tensor in (*self.cache.tensors(), self.token):
            torch._dynamo.mark_static_address(tensor)
        self._cuda = self.cache.seen.device.type == "cuda"
        self._forward = model if not compile else \
            torch.compile(model, mode="reduce-overhead", fullgraph=True) if self._cuda else \
            torch.compile(model, fullgraph=True, options=cpu_step_options())

    @property
    def capacity(self) -> int:
        """Tokens the fixed-shape cache holds (a ring for a sliding-window model)."""
        return self.cache.capacity

    def step(self, token: Tensor) -> Tensor:
        """Logits (B, 1, V) after the tokens (B, 1); the token joins the cache. On a GPU with
        ``compile`` the result lives in the graph's memory until the next step: use it first."""
        if token.shape != (self.batch_size, 1):
            raise ValueError(f"this StaticDecoder decodes ({self.batch_size}, 1) tokens, got "
                             f"{tuple(token.shape)}; build one per batch size")
        self.token.copy_(token)  # the graph reads a buffer: no input to copy or guard on
        if self.compiled and self._cuda:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are consumed
        return self._forward(self.token, kv_cache=self.cache, last_only=True)
