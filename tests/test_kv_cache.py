"""The KV cache's bookkeeping advances once per forward, told by the model before its blocks;
the layers only write (the decoding results themselves: test_sampling, test_static_decoding)."""

import pytest
import torch

from minigpt.kv_cache import KVCache
from minigpt.model import GPT, GPTConfig


def test_the_model_advances_its_cache_once_per_forward(monkeypatch):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, context_length=16, n_layer=3, n_head=2, n_embd=16)).eval()
    calls = []
    advance = KVCache.advance
    monkeypatch.setattr(KVCache, "advance",
                        lambda self, T, *args: calls.append(T) or advance(self, T, *args))
    cache = model.new_kv_cache(1)
    idx = torch.randint(0, 32, (1, 8))
    with torch.no_grad():
        model(idx[:, :5], kv_cache=cache)
        for i in range(5, 8):
            model(idx[:, i : i + 1], kv_cache=cache)
    assert calls == [5, 1, 1, 1]  # not once per layer
    assert cache.length == 8


def test_a_layer_of_a_deep_cache_cannot_write_before_the_model_advances_it():
    cache = KVCache(1, 2, 2, 8, 4)  # batch, layers, kv heads, capacity, head dim
    k = v = torch.zeros(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match="advances once per forward"):
        cache.layers[1].update(k, v)
    cache.advance(3)
    for layer in cache.layers:
        layer.update(k, v)
    assert cache.length == 3  # two layers wrote, the count moved once
