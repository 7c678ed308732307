"""Packed linear layers (minigpt.cpu.packed): same function as nn.Linear, decoding unchanged."""

import pytest
import torch
from torch import nn

from minigpt.cpu import onednn, speed_up_decoding
from minigpt.cpu.packed import PackedLinear
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


@pytest.mark.parametrize("wide", [False, True])  # True: the MKL path of wide (LM head) layers
@pytest.mark.parametrize("shape", [(5, 48), (1, 1, 48), (2, 7, 48)])
def test_packed_linear_matches_linear(shape, wide):
    linear = nn.Linear(48, 400 if wide else 80)
    x = torch.randn(shape)
    with torch.inference_mode():
        packed = PackedLinear.like(linear)
        assert packed.use_mkl == wide
        assert packed.weight is linear.weight and packed.bias is linear.bias
        torch.testing.assert_close(packed(x), linear(x))
        bf16 = PackedLinear.like(linear, torch.bfloat16)(x)
        assert bf16.dtype == torch.float32  # bfloat16 weights, float32 activations
        torch.testing.assert_close(bf16, linear(x), rtol=2e-2, atol=2e-2)


def test_speed_up_decoding_replaces_every_linear_and_keeps_the_function():
    model = tiny_model()
    keys = list(model.state_dict())
    idx = torch.randint(0, 64, (2, 10))
    with torch.inference_mode():
        expected = model(idx)
        applied = speed_up_decoding(model)
        assert applied == ["oneDNN-packed float32 linear weights (9)"]
        assert not any(isinstance(m, nn.Linear) for m in model.modules())
        assert isinstance(model.lm_head, PackedLinear)
        assert model.lm_head.weight is model.tok_emb.weight  # still tied
        assert list(model.state_dict()) == keys
        torch.testing.assert_close(model(idx), expected)


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
