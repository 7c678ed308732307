"""Fixed-shape decoding: ``GPT.forward`` on one token per row over a KV cache whose shapes never
change (``sliced=False``: the whole capacity under the mask of the filled slots, the token count
in a device tensor), compiled once for every token (a CUDA graph on a GPU, inductor's C++ on the
CPU). ``generate(..., decoder=StaticDecoder(model, B, compile=True))`` fills the cache from the
prompt eagerly, then calls ``step`` once per token. Shape letters: B batch, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["StaticDecoder", "cpu_step_options"]

# Capacities are rounded up to a multiple of this: nearby lengths share one compiled step.
CAPACITY_MULTIPLE = 64


def cpu_step_options() -> dict:
    """Inductor's options for the compiled CPU step. ``deterministic`` keeps a broadcast input
    (the LayerNorm a linear layer reads) a stored buffer instead of recomputing it for every
    weight row; no ``size_asserts``: dynamo's guards already check the inputs."""
    import torch._inductor.config as inductor_config

    options = {"size_asserts": False}
    if hasattr(inductor_config, "deterministic"):
        options["deterministic"] = True
    return options


class StaticDecoder:
    """A fixed-shape KV cache of ``model`` for ``batch_size`` rows, and its one-token step.

    ``capacity``: the most tokens a generation holds (rounded up, at most the model's default
    cache; None: that default). ``compile``: CUDA graphs on a GPU, inductor on the CPU; else
    eager (the tests' reference). Build one per batch size and reuse it: each compiles anew.
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
        """Logits (B, 1, V) after the tokens (B, 1), which join the cache. On a GPU with
        ``compile`` the result is overwritten by the next step."""
        if token.shape != (self.batch_size, 1):
            raise ValueError(f"this StaticDecoder decodes ({self.batch_size}, 1) tokens, got "
                             f"{tuple(token.shape)}; build one per batch size")
        self.token.copy_(token)  # the graph reads a buffer: no input to copy or guard on
        if self.compiled and self._cuda:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are consumed
        return self._forward(self.token, kv_cache=self.cache, last_only=True)
