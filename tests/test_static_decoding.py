"""The fixed-shape decoder (minigpt.static_decoding: GPT.forward over a ``sliced=False`` cache)
against two oracles: the eager KV-cache decoder and the model run on the whole window every step
(no cache). Every attention variant, left-padded prompts, crops and sliding-window rings; then
the compiled step (one graph, no recompiles) and the CUDA-graph path where a GPU is present."""

from __future__ import annotations

import pytest
import torch

from minigpt.model import GPT, GPTConfig
from minigpt.sampling import generate, pad_prompts
from minigpt.static_decoding import CAPACITY_MULTIPLE, StaticDecoder

pytestmark = pytest.mark.usefixtures("one_thread")

VARIANTS = {  # GPTConfig fields at 4 heads
    "gpt2": {},
    "gqa": {"num_kv_heads": 2},
    "mqa": {"num_kv_heads": 1},
    "rope": {"position": "rope"},
    "window": {"window": 5},
    "rope_window": {"position": "rope", "window": 5},
}


def tiny(name: str, context_length: int = 16, device: str = "cpu") -> GPT:
    torch.manual_seed(0)
    # init_std=1: greedy choices depend strongly on the context, so a wrong slot, position or
    # mask shows up as different tokens
    return GPT(GPTConfig(vocab_size=61, context_length=context_length, n_layer=2, n_head=4,
                         n_embd=32, init_std=1.0, **VARIANTS[name])).to(device).eval()


def _prompts(device="cpu"):
    return pad_prompts([[3, 1, 4, 1, 5, 9, 2], [6], [5, 3, 5]], device=device)


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("crop_to", [None, 16])
def test_greedy_tokens_match_eager_and_uncached_decoding(name, crop_to):
    model = tiny(name)
    idx, mask = _prompts()
    new = 40  # past the context (16) several times: crops, refills and ring wrap-arounds
    kwargs = dict(temperature=0, key_padding_mask=mask, crop_to=crop_to)
    uncached = generate(model, idx, new, use_cache=False, **kwargs)
    eager = generate(model, idx, new, **kwargs)
    static = generate(model, idx, new, decoder=StaticDecoder(model, 3), **kwargs)
    assert torch.equal(eager, uncached)
    assert torch.equal(static, uncached)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_compiled_decoder_matches_eager_and_uncached_decoding(name):
    """The compiled decoder (``GPT.forward`` over the fixed-shape cache, as generate.py runs it on
    a GPU; here inductor on the CPU) decodes the tokens of the eager decoder and of no cache, for
    one row and a left-padded batch, 40 tokens past the context (crops, refills, ring wraps)."""
    torch._dynamo.reset()
    model = tiny(name)
    for idx, mask in ((torch.tensor([[3, 1, 4, 1, 5]]), None), _prompts()):
        kwargs = dict(temperature=0, key_padding_mask=mask)
        uncached = generate(model, idx, 40, use_cache=False, **kwargs)
        assert torch.equal(generate(model, idx, 40, **kwargs), uncached)
        decoder = StaticDecoder(model, idx.shape[0], compile=True)
        assert torch.equal(generate(model, idx, 40, decoder=decoder, **kwargs), uncached)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_step_logits_match_the_eager_cache(name):
    model = tiny(name)
    idx, mask = _prompts()
    decoder = StaticDecoder(model, 3)
    eager_cache = model.new_kv_cache(3)
    position_ids = (torch.arange(7) - mask.sum(1, keepdim=True)).clamp(min=0)
    with torch.inference_mode():
        for cache in (decoder.cache, eager_cache):
            model(idx, key_padding_mask=mask, position_ids=position_ids, kv_cache=cache)
        for step in range(9):  # up to the context (16); the window models wrap their 5-slot rings
            token = torch.tensor([[step % 61], [7], [11 * step % 61]])
            positions = 7 + step - mask.sum(1, keepdim=True)
            expected = model(token, position_ids=positions, kv_cache=eager_cache)
            got = decoder.step(token)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)  # logits ~10


def test_seeded_sampling_is_the_same_with_either_decoder():
    model = tiny("gpt2")
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    runs = [generate(model, idx, 30, temperature=0.9, top_k=20, decoder=decoder,
                     generator=torch.Generator().manual_seed(5))
            for decoder in (None, StaticDecoder(model, 2))]
    assert torch.equal(*runs)


def test_a_decoder_is_reused_across_calls():
    model = tiny("rope_window")
    decoder = StaticDecoder(model, 1)
    for prompt in ([[1, 2, 3, 4, 5, 6, 7]], [[9]]):  # the second call must not see the first
        idx = torch.tensor(prompt)
        expected = generate(model, idx, 12, temperature=0)
        assert torch.equal(generate(model, idx, 12, temperature=0, decoder=decoder), expected)


def test_wrong_decoder_is_refused():
    model = tiny("gpt2")
    with pytest.raises(ValueError, match=r"built for another model or batch size \(2 rows, not 1"):
        generate(model, torch.tensor([[1]]), 3, decoder=StaticDecoder(model, 2))
    with pytest.raises(ValueError, match="use_cache=True or no decoder"):
        generate(model, torch.tensor([[1]]), 3, decoder=StaticDecoder(model, 1), use_cache=False)


def test_bfloat16_weights_keep_bfloat16_caches():
    model = tiny("gqa").to(torch.bfloat16)
    decoder = StaticDecoder(model, 1)
    keys, values = decoder.cache.keys, decoder.cache.values
    assert len(keys) == len(values) == 2  # one buffer per layer
    assert all(k.dtype == torch.bfloat16 for k in keys + values)
    assert keys[0].shape == (1, 2, 16, 8)  # batch, kv heads, slots, head dim
    idx = torch.tensor([[1, 2, 3]])
    assert torch.equal(generate(model, idx, 10, temperature=0, decoder=decoder),
                       generate(model, idx, 10, temperature=0))


def test_compiled_step_is_one_graph_for_every_step():
    """``compile=True`` traces the step once (fullgraph: no graph breaks) and never recompiles
    as the cache fills, wraps or is refilled after a crop: on a GPU, one CUDA graph."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny("rope_window")
    idx = torch.tensor([[3, 1, 4, 1, 5]])
    expected = generate(model, idx, 20, temperature=0)
    decoder = StaticDecoder(model, 1, compile=True)
    assert torch.equal(generate(model, idx, 20, temperature=0, decoder=decoder), expected)
    assert torch.equal(generate(model, idx[:, :2], 20, temperature=0, decoder=decoder),
                       generate(model, idx[:, :2], 20, temperature=0))
    assert counters["stats"]["unique_graphs"] == 1


def test_compiled_step_writes_the_caches_in_place():
    """The compiled step writes each new key/value into its slot; it never allocates a copy of
    a layer's cache (that would move the whole cache through memory on every token)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = tiny("gqa")
    decoder = StaticDecoder(model, 3, compile=True)
    with torch.inference_mode():
        _, code = run_and_get_code(decoder.step, torch.tensor([[1], [2], [3]]))
    cache_shape = str(tuple(decoder.cache.keys[0].shape))  # (3, 2, 16, 8)
    allocations = [line for line in "\n".join(code).splitlines()
                   if "empty_strided" in line and cache_shape in line]
    assert allocations == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", ["gpt2", "rope_window"])
def test_cuda_graph_decoding_matches_eager(name):
    """On a GPU the step is captured as a CUDA graph (none skipped) and decodes the same tokens
    as the eager decoder, for one row and for a left-padded batch past a crop or ring wrap."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny(name, device="cuda")  # float32: the two decoders agree to rounding
    one_row = torch.tensor([[3, 1, 4, 1, 5]], device="cuda")
    for idx, mask in ((one_row, None), _prompts("cuda")):
        decoder = StaticDecoder(model, idx.shape[0], compile=True)
        expected = generate(model, idx, 40, temperature=0, key_padding_mask=mask)
        for _ in range(2):  # the second call replays the captured graph
            got = generate(model, idx, 40, temperature=0, key_padding_mask=mask, decoder=decoder)
            assert torch.equal(got, expected), name
    skips = counters["inductor"]["cudagraph_skips"]
    assert skips == 0, f"{skips} CUDA graph capture(s) skipped: {dict(counters['inductor'])}"


@pytest.mark.parametrize("name", ["gpt2", "gqa", "rope", "window"])
def test_a_cache_sized_to_the_generation_decodes_the_same_tokens(name):
    """``capacity`` sizes the fixed-shape cache to prompt + new tokens (rounded up), so each
    step attends over only that; the tokens are those of no cache, compiled or not."""
    torch._dynamo.reset()
    model = tiny(name, context_length=256)  # the full cache would be 256 slots
    idx, mask = _prompts()
    kwargs = dict(temperature=0, key_padding_mask=mask)
    expected = generate(model, idx, 20, use_cache=False, **kwargs)
    for compile in (False, True):
        decoder = StaticDecoder(model, 3, capacity=7 + 20, compile=compile)
        assert decoder.capacity == (5 if name == "window" else CAPACITY_MULTIPLE)
        assert decoder.cache.keys[0].shape[2] == decoder.capacity
        assert torch.equal(generate(model, idx, 20, decoder=decoder, **kwargs), expected)


def test_a_decoder_too_small_for_the_generation_is_refused():
    model = tiny("gpt2", context_length=256)
    decoder = StaticDecoder(model, 1, capacity=10)  # 64 slots
    prompt = torch.tensor([[1, 2, 3, 4]])
    generate(model, prompt, 60, temperature=0, decoder=decoder)  # 64 tokens: fits
    with pytest.raises(ValueError, match=r"holds 64 tokens but this generation reaches 65 .*"
                                         r"StaticDecoder\(model, 1, capacity=65\)"):
        generate(model, prompt, 61, temperature=0, decoder=decoder)
    with pytest.raises(ValueError, match=r"capacity=0 must be a positive number of tokens"):
        StaticDecoder(model, 1, capacity=0)
    small = tiny("gpt2")  # context 16: crops keep every window within 16 tokens
    assert StaticDecoder(small, 1, capacity=1000).capacity == 16
    generate(small, prompt, 40, temperature=0, decoder=StaticDecoder(small, 1, capacity=10))
