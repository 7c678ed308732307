"""Packed linear layers (minigpt.packed): same function as nn.Linear, decoding unchanged."""

import pytest
import torch
from torch import nn

from minigpt.model import GPT, GPTConfig
from minigpt.packed import PackedLinear, can_pack, pack_linears
from minigpt.sampling import generate

pytestmark = [
    pytest.mark.skipif(not can_pack(), reason="needs PyTorch with oneDNN on the CPU"),
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
        packed = PackedLinear(linear)
        assert packed.use_mkl == wide
        torch.testing.assert_close(packed(x), linear(x))
        bf16 = PackedLinear(linear, torch.bfloat16)(x)
        assert bf16.dtype == torch.float32  # bfloat16 weights, float32 activations
        torch.testing.assert_close(bf16, linear(x), rtol=2e-2, atol=2e-2)


def test_pack_linears_replaces_every_linear_and_keeps_the_function():
    model = tiny_model()
    idx = torch.randint(0, 64, (2, 10))
    with torch.inference_mode():
        expected = model(idx)
        packed = pack_linears(model)
        assert not any(isinstance(m, nn.Linear) for m in packed.modules())
        assert isinstance(packed.lm_head, PackedLinear) and packed.tok_emb.weight.shape == (64, 32)
        torch.testing.assert_close(packed(idx), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_cached_decoding_equals_uncached(dtype):
    model = pack_linears(tiny_model(), dtype)
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    cached = generate(model, idx, 40, temperature=0)  # past context_length=24: crops
    assert torch.equal(cached, generate(model, idx, 40, temperature=0, use_cache=False))


def test_pack_linears_refuses_a_non_cpu_model():
    model = tiny_model().to("meta")
    with pytest.raises(ValueError, match="need a CPU model"):
        pack_linears(model)
