"""The running batch's decode step on fixed shapes, replayed from CUDA graphs on a GPU.

An eager step launches a few hundred small kernels, each from Python; on a GPU that launching,
not the arithmetic, bounds a small batch. ``FixedShapeSteps`` takes a fixed-shape cache over the
running batch's own KV cache buffers (``BatchCache.fixed_shape``: its first ``max_rows`` rows,
the whole context, nothing copied) and, for each pair of a row count in
``bucket_sizes(max_rows)`` and a slot count in multiples of ``SLOT_BUCKET``, a view of its first
rows and slots and, on a GPU, a CUDA graph of ``GPT.forward`` over that view
(``torch.cuda.CUDAGraph``, captured once at start-up). A step of B rows holding L tokens runs the
smallest view with at least B rows and L + 1 slots: the spare rows decode padding nobody reads,
and attention reads the slots in use, not the context. The rows' stream passes to the fixed
shapes with ``load`` and back with the running cache's ``restart_stream``; rows join and leave on
the running cache.
"""

from __future__ import annotations

import torch
from torch import Tensor

from minigpt.serve.cache import BatchCache

SLOT_BUCKET = 128  # a step attends over the filled slots rounded up to a multiple of this


def bucket_sizes(max_rows: int) -> list[int]:
    """Powers of two below ``max_rows``, then ``max_rows``."""
    sizes, size = [], 1
    while size < max_rows:
        sizes.append(size)
        size *= 2
    return [*sizes, max_rows]


class FixedShapeSteps:
    """One-token steps of ``model`` (placed, eval mode) for up to ``max_rows`` rows of the
    running batch's sliced ``cache`` (a ``BatchCache``), on fixed shapes over its buffers.
    ``capture``: record a CUDA graph per view (a GPU only); else each step runs the same forward
    eagerly (the tests' reference). ``slot_bucket``: the views' slot counts are its multiples
    (and the capacity)."""

    def __init__(self, model, cache: BatchCache, max_rows: int, *, capture: bool,
                 slot_bucket: int = SLOT_BUCKET):
        self.model, self.max_rows = model, max_rows
        self.cache = cache.fixed_shape(max_rows)
        self.tokens = torch.zeros(max_rows, 1, dtype=torch.long, device=cache.seen.device)
        self.sizes = bucket_sizes(max_rows)
        capacity = cache.capacity
        self.slot_sizes = [*range(slot_bucket, capacity, slot_bucket), capacity]
        self.views = {(rows, slots): self.cache.view(rows, slots)
                      for rows in self.sizes for slots in self.slot_sizes}
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.length = 0  # tokens in the stream
        if capture:
            self._capture()

    def load(self, cache: BatchCache) -> None:
        """Take up the stream of the running batch's sliced ``cache`` (the one given at
        construction): its rows in use step here until it ``restart_stream``s."""
        self.cache.continue_from(cache)
        self.length = cache.length

    def step(self, tokens: Tensor) -> Tensor:
        """Each of the B loaded rows reads its token (B, 1); the next token's logits (B, V),
        valid until the next step."""
        rows = tokens.shape[0]
        shape = (next(s for s in self.sizes if s >= rows),
                 next(s for s in self.slot_sizes if s > self.length))
        self.tokens[:rows].copy_(tokens)
        self.length += 1
        if shape in self.graphs:
            graph, logits = self.graphs[shape]
            graph.replay()
            return logits[:rows]
        return self._forward(shape)[:rows]

    def _forward(self, shape: tuple[int, int]) -> Tensor:
        return self.model(self.tokens[:shape[0]], kv_cache=self.views[shape],
                          last_only=True)[:, -1]

    @torch.inference_mode()
    def _capture(self) -> None:
        """Warm every view up on a side stream (as CUDA graph capture requires), then capture
        each, largest first, in one memory pool; the cache is emptied afterwards (at start-up,
        before any row joins)."""
        shapes = sorted(self.views, reverse=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for shape in shapes:
                self.cache.reset()  # a warm-up step writes a slot inside every view
                self._forward(shape)
        torch.cuda.current_stream().wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        for shape in shapes:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(shape)
            self.graphs[shape] = (graph, logits)
        self.cache.reset()
