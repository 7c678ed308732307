"""Fixed-shape decoding for GPUs: KV caches that never change shape, and a one-token step that
``torch.compile(mode="reduce-overhead")`` captures once as a CUDA graph and replays.

Why: at batch 1 a GPT-2-small decode step is ~200 small kernels. The eager decoder
(``minigpt.sampling``) attends over a slice of its caches that grows by one token per step, so
every step has new shapes and Python launches each kernel: the GPU mostly waits. Here the step
attends over the whole buffer under a mask of the filled slots, and the token count lives in a
device tensor, so one captured graph serves every step.

``StaticDecoder`` owns the buffers. ``generate(..., decoder=...)`` uses it this way:
``kv_caches()`` gives ordinary ``KVCache``/``RingKVCache`` views of the buffers, which the eager
model fills from the prompt (and refills after a crop); ``sync`` then describes what they hold
(which slots are real tokens, their stream indices, each row's position shift); ``step`` decodes
one token. Slot ``t % S`` takes the cache stream's token ``t``: the order the eager caches use, so
a ring buffer (sliding window) works the same way and a full cache is never wrapped (the
sampler crops first).

Shape letters: B batch, S cache slots, nkv key/value heads, hd head dim, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from minigpt.kv_cache import KVCache, RingKVCache

__all__ = ["StaticDecoder"]


class StaticDecoder(nn.Module):
    """Fixed-size KV caches of ``model`` for ``batch_size`` rows, and its one-token step.

    The caches are buffers of this module (a CUDA graph may write into buffers in place; it
    would skip the capture for other mutated inputs). With ``compile`` the step is compiled
    with ``mode="reduce-overhead"`` (CUDA graphs on a GPU); without it, it runs eagerly, as the
    reference the tests compare both decoders with. Build one per batch size and reuse it: each
    new decoder compiles its step again.
    """

    def __init__(self, model: nn.Module, batch_size: int, *, compile: bool = False):
        super().__init__()
        c = model.config
        weight = model.tok_emb.weight
        S, hd = model.kv_cache_capacity(), c.n_embd // c.n_head
        like = {"device": weight.device, "dtype": weight.dtype}
        self.model = model
        self.batch_size, self.window, self.ring = batch_size, c.window, c.window is not None
        # One buffer per layer and per keys/values, not slices of one tensor: the graph writes a
        # token's slot in place only when the tensor it writes is a graph input itself; into a
        # view of a shared buffer, inductor copies each layer's whole cache every step.
        for layer in range(c.n_layer):
            for name in ("keys", "values"):
                self.register_buffer(f"{name}_{layer}",
                                     torch.zeros(batch_size, c.kv_heads, S, hd, **like))
        device = weight.device
        self.register_buffer("padding", torch.zeros(batch_size, S, dtype=torch.bool, device=device))
        self.register_buffer("stream_index", torch.full((S,), -1, dtype=torch.long, device=device))
        self.register_buffer("real", torch.zeros(batch_size, S, dtype=torch.bool, device=device))
        self.register_buffer("token", torch.zeros(batch_size, 1, dtype=torch.long, device=device))
        self.register_buffer("next_index", torch.zeros(1, dtype=torch.long, device=device))
        self.register_buffer("row_shift", torch.zeros(batch_size, 1, dtype=torch.long,
                                                      device=device))
        for buffer in self.buffers():  # the graph may read and write them in place
            torch._dynamo.mark_static_address(buffer)
        self.compiled = compile
        self._step = torch.compile(self._decode_step, mode="reduce-overhead", fullgraph=True) \
            if compile else self._decode_step

    @property
    def keys(self) -> list[Tensor]:
        """Each layer's key buffer (B, nkv, S, hd)."""
        return [getattr(self, f"keys_{layer}") for layer in range(len(self.model.blocks))]

    @property
    def values(self) -> list[Tensor]:
        """Each layer's value buffer (B, nkv, S, hd)."""
        return [getattr(self, f"values_{layer}") for layer in range(len(self.model.blocks))]

    @property
    def capacity(self) -> int:
        return self.keys_0.shape[2]

    def kv_caches(self) -> list[KVCache]:
        """The model's caches as views of this decoder's buffers, for the eager prompt pass."""
        kind = RingKVCache if self.ring else KVCache
        caches = [kind(keys=k, values=v, padding=self.padding)
                  for k, v in zip(self.keys, self.values, strict=True)]
        for cache in caches:
            if self.ring:
                cache.positions = self.stream_index  # every layer writes the same indices
            cache.reset()
        return caches

    @torch.no_grad()
    def sync(self, caches: list[KVCache], starts: list[int]) -> None:
        """Read what the eager pass left in ``caches`` (from ``kv_caches``): the next stream
        index, which slots hold real tokens, and each row's position shift (its window start
        ``starts[row]`` past the earliest one, for left-padded prompts)."""
        cache = caches[0]
        if not self.ring:  # a full cache holds tokens 0 .. length-1 in slots 0 .. length-1
            slots = torch.arange(self.capacity, device=self.stream_index.device)
            self.stream_index.copy_(torch.where(slots < cache.length, slots, -1))
        self.real.copy_(~self.padding & (self.stream_index >= 0))
        self.next_index.fill_(cache.length)
        first = min(starts)
        self.row_shift.copy_(torch.tensor([[s - first] for s in starts]))

    def step(self, token: Tensor) -> Tensor:
        """Logits (B, 1, V) after the tokens (B, 1); the token joins the caches. On a GPU with
        ``compile`` the result lives in the graph's memory until the next step: use it first."""
        if token.shape != (self.batch_size, 1):
            raise ValueError(f"this StaticDecoder decodes ({self.batch_size}, 1) tokens, got "
                             f"{tuple(token.shape)}; build one per batch size")
        self.token.copy_(token)  # the graph reads a buffer: no input to copy or guard on
        if self.compiled:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are consumed
        return self._step()

    def _decode_step(self) -> Tensor:
        """``GPT.hidden_states`` + LM head for one token per row, with fixed shapes (the same
        sums in the same order as ``Block.forward``; tests check the two decoders agree)."""
        t = self.next_index  # (1,) this token's stream index
        slot = t % self.capacity
        self.stream_index.index_copy_(0, slot, t)
        self.real.index_fill_(1, slot, True)
        visible = self.real if self.window is None \
            else self.real & (self.stream_index > t - self.window)  # (B, S)
        position_ids = t - self.row_shift  # (B, 1)
        model = self.model
        x = model.drop(model.embed(self.token, position_ids))  # (B, 1, C)
        for block, keys, values in zip(model.blocks, self.keys, self.values, strict=True):
            attended = block.attn.decode_into(block.norm1(x), keys, values, slot, visible,
                                              position_ids)
            x = x + block.drop(attended)
            x = x + block.drop(block.mlp(block.norm2(x)))
        self.next_index.add_(1)
        return model.lm_head(model.final_norm(x))
