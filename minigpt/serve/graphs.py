"""The running batch's decode step on fixed shapes, replayed from CUDA graphs on a GPU.

An eager step launches a few hundred small kernels, each from Python; on a GPU that launching,
not the arithmetic, bounds a small batch. ``FixedShapeSteps`` keeps one fixed-shape KV cache
(``minigpt.kv_cache``, ``sliced=False``) of ``max_rows`` rows and the whole context, and for
each batch size of ``bucket_sizes`` a view of its first rows and, on a GPU, a CUDA graph of
``GPT.forward`` over that view (``torch.cuda.CUDAGraph``, captured once at start-up). A step of B
rows feeds the smallest bucket of at least B rows; the spare rows decode padding nobody reads.
The rows enter with ``load`` (a copy of the running batch's sliced cache) and leave with
``sliced_rows``, so rows join and leave on the eager cache, as before.
"""

from __future__ import annotations

import torch
from torch import Tensor


def bucket_sizes(max_rows: int) -> list[int]:
    """Powers of two below ``max_rows``, then ``max_rows``."""
    sizes, size = [], 1
    while size < max_rows:
        sizes.append(size)
        size *= 2
    return [*sizes, max_rows]


class FixedShapeSteps:
    """One-token steps of ``model`` (placed, eval mode) for up to ``max_rows`` rows over a
    fixed-shape cache of ``capacity`` tokens a row. ``capture``: record a CUDA graph per bucket
    (a GPU only); else each step runs the same forward eagerly (the tests' reference)."""

    def __init__(self, model, max_rows: int, capacity: int, *, capture: bool):
        self.model, self.max_rows = model, max_rows
        self.cache = model.new_kv_cache(max_rows, capacity, sliced=False)
        self.tokens = torch.zeros(max_rows, 1, dtype=torch.long, device=self.cache.seen.device)
        self.sizes = bucket_sizes(max_rows)
        self.views = {size: self.cache.view_rows(size) for size in self.sizes}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        if capture:
            self._capture()

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    def load(self, cache) -> None:
        """Take the rows of the running batch's sliced ``cache`` (copied in)."""
        self.cache.load(cache)

    def sliced_rows(self, count: int):
        """The first ``count`` rows as a new sliced cache, for rows to join or leave."""
        return self.cache.sliced_rows(count)

    def step(self, tokens: Tensor) -> Tensor:
        """Each of the B loaded rows reads its token (B, 1); the next token's logits (B, V),
        valid until the next step."""
        rows = tokens.shape[0]
        size = next(s for s in self.sizes if s >= rows)
        self.tokens[:rows].copy_(tokens)
        if size in self.graphs:
            graph, logits = self.graphs[size]
            graph.replay()
            return logits[:rows]
        return self._forward(size)[:rows]

    def _forward(self, size: int) -> Tensor:
        return self.model(self.tokens[:size], kv_cache=self.views[size], last_only=True)[:, -1]

    def _capture(self) -> None:
        """Warm every bucket up on a side stream (as CUDA graph capture requires), then capture
        each, largest first, in one memory pool; the cache is emptied afterwards."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for size in self.sizes:
                for _ in range(2):
                    self._forward(size)
        torch.cuda.current_stream().wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(size)
            self.graphs[size] = (graph, logits)
        self.cache.reset()
