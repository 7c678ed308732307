"""Packed linear layers (minigpt.cpu.packed): same function as nn.Linear, decoding unchanged;
each layout chosen by rule, and bfloat16 stepping aside where oneDNN cannot run it."""

import pytest
import torch
from torch import nn

from minigpt.cpu import onednn, speed_up_decoding
from minigpt.cpu.packed import (
    KERNELS,
    PROMPT_PRODUCTS,
    ROWSUM,
    PackedLinear,
    prompt_product,
)
from minigpt.model import GPT, GPTConfig
from minigpt.sampling import generate

pytestmark = [
    pytest.mark.skipif(not onednn.available(), reason="needs PyTorch with oneDNN on the CPU"),
    pytest.mark.usefixtures("one_thread"),
]


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, context_length=24, n_layer=2, n_head=2, n_embd=32,
                         init_std=1.0)).eval()


def rounded_model(seed: int, dtype: torch.dtype) -> GPT:
    """``tiny_model(seed)`` in float32 with its linear weights rounded to ``dtype``: the oracle
    of a decoder on ``dtype`` weights and float32 activations."""
    model = tiny_model(seed)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, nn.Linear):
                layer.weight.copy_(layer.weight.to(dtype).float())
    return model


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", [(5, 48), (1, 1, 48), (2, 7, 48)])
def test_packed_linear_matches_linear(shape, kernel):
    linear = nn.Linear(48, 80)
    x = torch.randn(shape)
    with torch.inference_mode():
        packed = PackedLinear(linear, kernel=kernel)
        assert packed.weight is linear.weight and packed.bias is linear.bias
        torch.testing.assert_close(packed(x), linear(x))
        if kernel == "onednn" and not onednn.packs_bfloat16():
            return  # refused: test_onednn_bfloat16_is_refused_where_the_cpu_lacks_it
        bf16 = PackedLinear(linear, torch.bfloat16, kernel)(x)
        assert bf16.dtype == torch.float32  # bfloat16 weights, float32 activations
        torch.testing.assert_close(bf16, linear(x), rtol=2e-2, atol=2e-2)


def test_onednn_bfloat16_is_refused_where_the_cpu_lacks_it(avx2_only):
    with pytest.raises(ValueError, match="this CPU has AVX2: use kernel='plain' or 'rowsum'"):
        PackedLinear(nn.Linear(4, 4), torch.bfloat16, "onednn")
    with pytest.raises(ValueError, match="kernel='mkl' must be one of"):
        PackedLinear(nn.Linear(4, 4), kernel="mkl")


@pytest.mark.parametrize("product", PROMPT_PRODUCTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rowsum_prompt_rows_by_either_product_widen_block_by_block(monkeypatch, dtype, product):
    """Outside the compiled step (the prompt), several rows by row-sum weights, either product,
    bfloat16 weights widened a few rows at a time: the product of the float32 layer on the
    rounded weights, block edges and all."""
    import minigpt.cpu.packed as packed

    monkeypatch.setattr(packed, "WIDEN_BYTES", 7 * 48 * 4)  # blocks of 7 rows of 80: uneven
    linear = nn.Linear(48, 80)
    x = torch.randn(2, 5, 48)
    rounded = nn.Linear(48, 80)
    with torch.no_grad():
        rounded.weight.copy_(linear.weight.to(dtype).float())
        rounded.bias.copy_(linear.bias)
        layer = PackedLinear(linear, dtype, ROWSUM)
        layer.product = product
        torch.testing.assert_close(layer(x), rounded(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="product='x @ W'"):
        packed.matmul_packed(x[0], layer._packed, None, ROWSUM, "x @ W")


@pytest.mark.parametrize("threads, dtype, product", [
    (1, torch.float32, "x @ W.T"), (1, torch.bfloat16, "W @ x.T"),
    (2, torch.float32, "W @ x.T"), (8, torch.bfloat16, "W @ x.T")])
def test_a_prompts_product_is_chosen_by_thread_count_and_dtype(threads, dtype, product):
    assert prompt_product(dtype, threads) == product


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_rowsum_streams_the_weight_in_float32(dtype):
    """Compiled, a one-row product of the row-sum layout is one fused loop (no GEMM call) that
    sums in float32: against float64 on the same ``dtype``-rounded weights, to float32
    rounding (the eager bfloat16 layouts, which round the row to bfloat16, miss by ~1e-2)."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    linear = nn.Linear(256, 96)
    x = torch.randn(1, 1, 256)
    expected = x.double() @ linear.weight.detach().to(dtype).double().T + linear.bias.double()
    layer = PackedLinear(linear, dtype, ROWSUM)
    torch._dynamo.reset()
    with torch.inference_mode():
        y, code = run_and_get_code(torch.compile(layer, fullgraph=True, dynamic=False), x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)
    assert "mm(" not in "".join(code) and "cpp_fused" in "".join(code)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_speed_up_decoding_packs_every_layer_and_keeps_the_function(dtype):
    model = tiny_model()
    keys = list(model.state_dict())
    idx = torch.randint(0, 64, (2, 10))
    expected = model(idx)
    with torch.inference_mode():
        applied = speed_up_decoding(model, dtype)
        kernel = "onednn" if onednn.packs_bfloat16() or dtype == torch.float32 else "plain"
        if kernel == "onednn":
            assert applied == [f"oneDNN-packed {str(dtype)[6:]} linear weights (9)"]
        layers = [m for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear))]
        assert len(layers) == 9 and all(type(m) is PackedLinear and m.kernel == kernel
                                        and m.weight_dtype == dtype for m in layers)
        assert model.lm_head.weight is model.tok_emb.weight  # still tied
        assert list(model.state_dict()) == keys
        if dtype == torch.float32:  # (bfloat16 rounds the rows too: decoded below)
            torch.testing.assert_close(model(idx), expected)


def test_bfloat16_steps_aside_where_onednn_cannot_run_it(avx2_only):
    """As on an AVX2-only CPU: the bfloat16 weights multiply through F.linear, and the line says
    why; the model still decodes, cached as uncached."""
    model = tiny_model()
    applied = speed_up_decoding(model, torch.bfloat16)
    assert applied == ["bfloat16 weights through F.linear (9): oneDNN's packed bfloat16 layout "
                       "needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; this CPU has AVX2"]
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == 9 and {m.kernel for m in layers} == {"plain"}
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    cached = generate(model, idx, 30, temperature=0)
    assert torch.equal(cached, generate(model, idx, 30, temperature=0, use_cache=False))


def test_float32_keeps_nn_linear_without_onednn(monkeypatch):
    monkeypatch.setattr(onednn, "available", lambda: False)
    model = tiny_model()
    assert speed_up_decoding(model) == [
        "nn.Linear kept (9: oneDNN's linear op is missing from this PyTorch)"]
    assert type(model.lm_head) is nn.Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_cached_decoding_equals_uncached(dtype):
    model = tiny_model()
    speed_up_decoding(model, dtype)
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    cached = generate(model, idx, 40, temperature=0)  # past context_length=24: crops
    assert torch.equal(cached, generate(model, idx, 40, temperature=0, use_cache=False))


def test_speed_up_decoding_leaves_a_non_cpu_model_alone():
    model = tiny_model().to("meta")
    assert speed_up_decoding(model) == []
    assert type(model.blocks[0].attn.qkv) is nn.Linear


def test_speed_up_decoding_refuses_float16_weights():
    with pytest.raises(ValueError, match="weight_dtype=torch.float16"):
        speed_up_decoding(tiny_model(), torch.float16)


def test_decoding_never_reads_cache_slots_it_has_not_written(monkeypatch):
    """The eager cache is allocated without zeroing (no fill_ per generation): slots not yet
    written hold whatever memory held; NaN there must not reach a single logit."""
    model = tiny_model()
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    expected = generate(model, idx, 30, temperature=0, use_cache=False)
    new_kv_cache = model.new_kv_cache

    def poisoned(*args, **kwargs):
        cache = new_kv_cache(*args, **kwargs)
        for buffer in cache.keys + cache.values:
            buffer.fill_(float("nan"))
        return cache

    monkeypatch.setattr(model, "new_kv_cache", poisoned)
    assert torch.equal(generate(model, idx, 30, temperature=0), expected)  # crops at 24 too


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_traceable_takes_rowsum_and_the_compiled_step_decodes_the_uncached_tokens(
        dtype, threads, avx2_only):
    """``traceable``: every layer takes the row-sum layout (oneDNN is not needed, bfloat16
    included), its prompt product by the rule for the thread count, and the compiled fixed-shape
    step decodes the tokens of the uncached model with the same (``dtype``-rounded) weights in
    float32."""
    from minigpt.static_decoding import StaticDecoder

    torch.set_num_threads(threads)  # the one_thread fixture restores the count
    model = tiny_model()
    idx = torch.tensor([[1, 2, 3]])
    expected = generate(rounded_model(0, dtype), idx, 30, temperature=0, use_cache=False)
    applied = speed_up_decoding(model, dtype, traceable=True)
    name = str(dtype).removeprefix("torch.")
    product = prompt_product(dtype, threads)
    assert applied == [f"row-sum {name} weights (9: the compiled step streams each one-row "
                       "product over the weight in its own loop)",
                       f"a prompt's rows as {product} ({threads} thread(s), {name})",
                       "one-query attention fused into the compiled step (2)"]
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear))]
    assert all(type(m) is PackedLinear and m.kernel == ROWSUM and m.product == product
               for m in layers)
    assert model.lm_head.weight is model.tok_emb.weight  # still tied
    torch._dynamo.reset()
    decoder = StaticDecoder(model, 1, compile=True, capacity=33)
    assert torch.equal(generate(model, idx, 30, temperature=0, decoder=decoder), expected)


def test_compiled_decoders_of_several_models_in_one_process_each_decode_their_own():
    """Compiled CPU steps of several models in one process (the bench, a test run): each model
    decodes its own tokens; none runs a step compiled for another model's weights."""
    from minigpt.static_decoding import StaticDecoder

    torch._dynamo.reset()
    for dtype, batch, seed in ((torch.float32, 1, 0), (torch.bfloat16, 1, 1),
                               (torch.float32, 3, 2), (torch.bfloat16, 3, 3)):
        model = tiny_model(seed)
        idx = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])[:batch]
        expected = generate(rounded_model(seed, dtype), idx, 12, temperature=0, use_cache=False)
        speed_up_decoding(model, dtype, traceable=True)
        decoder = StaticDecoder(model, batch, compile=True, capacity=15)
        assert torch.equal(generate(model, idx, 12, temperature=0, decoder=decoder), expected)
