"""The rows decoding together: one KV cache (``minigpt.serve.cache``) with a row per request.

A request joins between steps: its prompt is read in its own forward pass (prompts that arrive
together as one left-padded batch, each row at its own positions, as ``generate`` reads several)
and the rows of that prefill cache are copied into the running cache's next rows (``BatchCache``),
their tokens ending where the running rows' do. A request leaves by dropping its row. Every step
feeds each row its last token through ``GPT.forward`` with the cache: the one decode path, each
row at its own position, padding never attended to, so a row's tokens do not depend on the others
(up to the rounding of a larger matrix product). With ``graph_rows``, the steps of up to that many
rows between two changes of the rows run on fixed shapes over the same buffers
(``minigpt.serve.graphs``: CUDA graphs on a GPU).

Shape letters: B rows, T prompt tokens, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from minigpt.sampling import pad_prompts
from minigpt.serve.cache import BatchCache
from minigpt.serve.graphs import SLOT_BUCKET, FixedShapeSteps


class RunningBatch:
    """The KV cache of up to ``max_rows`` running rows of ``model`` (``capacity`` tokens each)
    and, per row, its owner (any object; ``owners``). ``graph_rows`` > 0: steps of up to that
    many rows run on ``FixedShapeSteps`` (``capture``: from CUDA graphs; ``slot_bucket``: its
    views' slot counts)."""

    def __init__(self, model, capacity: int, max_rows: int, *, graph_rows: int = 0,
                 capture: bool = False, slot_bucket: int = SLOT_BUCKET):
        self.model = model
        self.owners: list = []
        self.cache = model.new_kv_cache(max_rows, capacity, cache_class=BatchCache)
        self.fixed_steps = None if graph_rows <= 0 else FixedShapeSteps(
            model, self.cache, min(graph_rows, max_rows), capture=capture,
            slot_bucket=slot_bucket)
        self._in_fixed = False  # the stream is the fixed steps' (``cache``'s count is stale)

    def __len__(self) -> int:
        return len(self.owners)

    def prefill(self, prompts: list[list[int]], *, all_positions: bool = False):
        """Read ``prompts`` into a fresh cache (left-padded, each at its own positions): their
        logits (R, V) at the last token, or (R, T, V) at every token with ``all_positions``,
        and the cache, for ``join``."""
        device = self.model.tok_emb.weight.device
        cache = self.model.new_kv_cache(len(prompts), max(map(len, prompts)))
        idx, padding = pad_prompts(prompts, device=device)
        if not bool(padding.any()):
            logits = self.model(idx, kv_cache=cache, last_only=not all_positions)
        else:
            positions = (torch.arange(idx.shape[1], device=device)[None]
                         - padding.sum(dim=1, keepdim=True)).clamp(min=0)
            logits = self.model(idx, key_padding_mask=padding, position_ids=positions,
                                kv_cache=cache, last_only=not all_positions)
        return (logits if all_positions else logits[:, -1]), cache

    def join(self, cache, owners: list) -> None:
        """Append the rows of a ``prefill`` cache, owned by ``owners``."""
        self._take_back()
        self.cache.append_rows(cache)
        self.owners += owners

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (indices, in order); the others leave the batch."""
        if len(rows) == len(self.owners):
            return
        self._take_back()
        self.cache.keep_rows(rows)
        self.owners = [self.owners[r] for r in rows]

    def step(self, tokens: Tensor) -> Tensor:
        """Each row reads its token (B, 1); the next token's logits (B, V)."""
        fixed, capacity = self.fixed_steps, self.cache.capacity
        if self._in_fixed and fixed.length == capacity:
            self._take_back()
        if not self._in_fixed and self.cache.length == capacity:
            self.cache.drop_leading_padding()
        if fixed is None or len(self.owners) > fixed.max_rows:
            return self.model(tokens, kv_cache=self.cache, last_only=True)[:, -1]
        if not self._in_fixed:
            fixed.load(self.cache)
            self._in_fixed = True
        return fixed.step(tokens)

    def _take_back(self) -> None:
        """The stream back from ``fixed_steps``, where the last steps ran."""
        if self._in_fixed:
            self.cache.restart_stream(self.fixed_steps.length)
            self._in_fixed = False
