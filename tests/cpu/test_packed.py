"""Packed linear layers (minigpt.cpu.packed): same function as nn.Linear, decoding unchanged."""

import pytest
import torch
from torch import nn

from minigpt.cpu import onednn, speed_up_decoding
from minigpt.cpu.packed import (
    DECODE_KERNELS,
    PROMPT_PRODUCTS,
    ROWSUM,
    PackedLinear,
    measure_prompt,
    prompt_key,
)
from minigpt.cpu.tuning import CLOSE_CALL_RUNS
from minigpt.model import GPT, GPTConfig
from minigpt.sampling import generate

pytestmark = [
    pytest.mark.skipif(not onednn.available(), reason="needs PyTorch with oneDNN on the CPU"),
    pytest.mark.usefixtures("one_thread"),
]


SHAPES = ["32x64", "32x96", "32x32", "32x128", "128x32"]  # in x out, in the model's order


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


@pytest.mark.parametrize("kernel", [*DECODE_KERNELS, ROWSUM])
@pytest.mark.parametrize("shape", [(5, 48), (1, 1, 48), (2, 7, 48)])
def test_packed_linear_matches_linear(shape, kernel):
    linear = nn.Linear(48, 80)
    x = torch.randn(shape)
    with torch.inference_mode():
        packed = PackedLinear.like(linear, kernel=kernel)
        assert packed.weight is linear.weight and packed.bias is linear.bias
        torch.testing.assert_close(packed(x), linear(x))
        bf16_kernel = kernel if kernel in ("onednn", ROWSUM) else "onednn"
        bf16 = PackedLinear.like(linear, torch.bfloat16, bf16_kernel)(x)
        assert bf16.dtype == torch.float32  # bfloat16 weights, float32 activations
        torch.testing.assert_close(bf16, linear(x), rtol=2e-2, atol=2e-2)


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
        layer = PackedLinear.like(linear, dtype, ROWSUM)
        layer.product = product
        torch.testing.assert_close(layer(x), rounded(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="product='x @ W'"):
        packed.matmul_packed(x[0], layer._packed, None, ROWSUM, "x @ W")


def test_measure_prompt_times_each_product_per_shape():
    layers = [m for m in tiny_model().modules() if isinstance(m, nn.Linear)]
    keys = ["prompt bfloat16 32x96", "prompt bfloat16 128x32"]  # two of the model's shapes
    assert set(keys) <= {prompt_key(layer, torch.bfloat16) for layer in layers}
    timings = measure_prompt(layers, keys, torch.bfloat16, sweeps=1)
    assert sorted(timings) == sorted(keys)
    assert all(set(t) == set(PROMPT_PRODUCTS) and min(t.values()) > 0 for t in timings.values())


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
    layer = PackedLinear.like(linear, dtype, ROWSUM)
    torch._dynamo.reset()
    with torch.inference_mode():
        y, code = run_and_get_code(torch.compile(layer, fullgraph=True, dynamic=False), x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)
    assert "mm(" not in "".join(code) and "cpp_fused" in "".join(code)


def test_bfloat16_weights_have_one_layout():
    with pytest.raises(ValueError, match="kernel='mkl'"):
        PackedLinear.like(nn.Linear(4, 4), torch.bfloat16, kernel="mkl")


@pytest.mark.parametrize("fastest, kind", [("mkl", PackedLinear), ("onednn", PackedLinear),
                                           ("plain", nn.Linear)])
def test_speed_up_decoding_takes_the_fastest_layout_and_keeps_the_function(fastest, kind,
                                                                           fake_timings):
    fake_timings(decode={"plain": 1.0, "mkl": 1.0, "onednn": 1.0, fastest: 0.5})
    model = tiny_model()
    keys = list(model.state_dict())
    idx = torch.randint(0, 64, (2, 10))
    with torch.inference_mode():
        expected = model(idx)
        applied = speed_up_decoding(model)
        label = {"mkl": "(in, out) MKL float32 weights", "onednn": "oneDNN-packed float32 weights",
                 "plain": "nn.Linear kept"}[fastest]
        ratio = "x0.50" if fastest == "plain" else "x2.00"  # nn.Linear kept: the best layout's
        shapes = ", ".join(f"{shape} {ratio}" for shape in SHAPES)
        assert applied == [f"{label} (9: {shapes}; measured)"]
        layers = [m for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear))]
        assert len(layers) == 9 and all(type(m) is kind for m in layers)
        assert all(m.kernel == fastest for m in layers if kind is PackedLinear)
        assert model.lm_head.weight is model.tok_emb.weight  # still tied
        assert list(model.state_dict()) == keys
        torch.testing.assert_close(model(idx), expected)


def test_decoding_layouts_are_measured_once_per_machine(fake_timings):
    calls = fake_timings(decode={"plain": 1.0, "mkl": 1.25, "onednn": 2.0})  # plain: clearly
    shapes = ", ".join(f"{shape} x0.80" for shape in SHAPES)
    assert speed_up_decoding(tiny_model()) == [f"nn.Linear kept (9: {shapes}; measured)"]
    assert speed_up_decoding(tiny_model()) == [f"nn.Linear kept (9: {shapes}; cached)"]
    assert calls == [[f"decode float32 {shape}" for shape in sorted(SHAPES)]]


def test_a_close_call_is_measured_again_and_keeps_nn_linear(fake_timings):
    """1.03x is within MARGIN: nn.Linear stays, and the shape is measured on the next start-ups
    until it has CLOSE_CALL_RUNS measurements; then the file is trusted."""
    calls = fake_timings(decode={"plain": 1.0, "mkl": 0.97, "onednn": 2.0})
    for _ in range(CLOSE_CALL_RUNS + 2):
        assert speed_up_decoding(tiny_model())[0].startswith("nn.Linear kept (9: ")
    assert len(calls) == CLOSE_CALL_RUNS


def test_real_measurement_picks_a_layout_and_decodes_the_same_tokens():
    model = tiny_model()
    idx = torch.tensor([[1, 2, 3]])
    expected = generate(model, idx, 12, temperature=0, use_cache=False)
    applied = speed_up_decoding(model)
    assert applied and all(line.endswith("; measured)") for line in applied)
    assert torch.equal(generate(model, idx, 12, temperature=0), expected)


@pytest.mark.parametrize("dtype, fastest", [(torch.float32, "mkl"), (torch.float32, "onednn"),
                                           (torch.bfloat16, "onednn")])
def test_packed_cached_decoding_equals_uncached(dtype, fastest, fake_timings):
    fake_timings(decode={"plain": 1.0, "mkl": 1.0, "onednn": 1.0, fastest: 0.5})
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


@pytest.mark.parametrize("faster", PROMPT_PRODUCTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_traceable_takes_rowsum_and_the_compiled_step_decodes_the_uncached_tokens(
        dtype, faster, fake_timings):
    """``traceable``: every layer takes the row-sum layout, whatever the eager timings say (none
    are measured), its prompt product the one measured faster (``x @ W.T`` unless the other is),
    and the compiled fixed-shape step decodes the tokens of the uncached model with the same
    (``dtype``-rounded) weights in float32."""
    from minigpt.static_decoding import StaticDecoder

    calls = fake_timings(decode={"plain": 1.0, "mkl": 0.8, "onednn": 0.5},
                         prompt={"x @ W.T": 1.0, "W @ x.T": 1.0, faster: 0.5})
    model = tiny_model()
    idx = torch.tensor([[1, 2, 3]])
    expected = generate(rounded_model(0, dtype), idx, 30, temperature=0, use_cache=False)
    applied = speed_up_decoding(model, dtype, traceable=True)
    name = str(dtype).removeprefix("torch.")
    ratio = "x2.00" if faster == "W @ x.T" else "x0.50"  # kept: the other product's ratio
    kept = "" if faster == "W @ x.T" else " kept"
    assert applied == [f"row-sum {name} weights (9: the compiled step streams each one-row "
                       "product over the weight in its own loop)",
                       f"a prompt's rows as {faster}{kept} (9: "
                       + ", ".join(f"{shape} {ratio}" for shape in SHAPES) + "; measured)",
                       "one-query attention fused into the compiled step (2)"]
    assert calls == [sorted(f"prompt {name} {shape}" for shape in SHAPES)]
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear))]
    assert all(type(m) is PackedLinear and m.kernel == ROWSUM and m.product == faster
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
