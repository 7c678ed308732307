"""minigpt.cpu.packed.one_query_attention: the compiled CPU step's one-query attention, against the
attention formula written out here (softmax of the scaled scores under the mask, times the
values), compiled and eager, with grouped key/value heads; and whole models decoded through it."""

import math

import pytest
import torch

from minigpt.cpu import speed_up_decoding
from minigpt.cpu.packed import one_query_attention
from minigpt.model import GPT, GPTConfig
from minigpt.sampling import generate
from minigpt.static_decoding import StaticDecoder


def formula(q, k, v, mask):
    """The attention of each query head over its key/value head, in float64, one head at a
    time: softmax(q k^T / sqrt(hd)) v, masked keys excluded."""
    B, nh, _, hd = q.shape
    nkv = k.shape[1]
    out = torch.empty(B, nh, 1, hd, dtype=torch.float64)
    for b in range(B):
        for h in range(nh):
            kv = h // (nh // nkv)
            scores = (k[b, kv].double() @ q[b, h, 0].double()) / math.sqrt(hd)  # (L,)
            if mask is not None:
                scores = scores.masked_fill(~mask[min(b, mask.shape[0] - 1), 0, 0], -math.inf)
            out[b, h, 0] = torch.softmax(scores, 0) @ v[b, kv].double()
    return out


@pytest.mark.parametrize("nh, nkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("mask_rows", [None, 1, 3])
@pytest.mark.parametrize("compiled", [False, True])
def test_one_query_attention_is_the_formula(nh, nkv, mask_rows, compiled):
    torch.manual_seed(0)
    B, L, hd = 3, 11, 8
    q, k, v = torch.randn(B, nh, 1, hd), torch.randn(B, nkv, L, hd), torch.randn(B, nkv, L, hd)
    mask = None
    if mask_rows is not None:
        mask = torch.rand(mask_rows, 1, 1, L) < 0.6
        mask[..., 0] = True  # every row sees one key at least (a new token sees itself)
    if compiled:
        torch._dynamo.reset()  # one graph per case: no recompile limit across the cases
    attend = torch.compile(one_query_attention, fullgraph=True) if compiled else \
        one_query_attention
    torch.testing.assert_close(attend(q, k, v, mask).double(), formula(q, k, v, mask),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", [{}, {"num_kv_heads": 1, "position": "rope", "window": 6}])
def test_compiled_step_with_fused_attention_decodes_the_uncached_tokens(variant):
    """A compiled fixed-shape step over the fused attention (grouped heads, rope and a sliding
    window's ring cache too) decodes the greedy tokens of the same model without a cache."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, context_length=24, n_layer=2, n_head=4, n_embd=32,
                          init_std=1.0, **variant)).eval()
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    expected = generate(model, idx, 18, temperature=0, use_cache=False)
    applied = speed_up_decoding(model, torch.float32, traceable=True)
    assert applied[-1] == "one-query attention fused into the compiled step (2)"
    torch._dynamo.reset()
    decoder = StaticDecoder(model, 2, compile=True, capacity=21)
    assert torch.equal(generate(model, idx, 18, temperature=0, decoder=decoder), expected)


def test_the_fused_attention_patches_instances_only():
    """The core's MultiHeadAttention carries no hook: the fused attention patches the decoded
    model's instances (once), and another model keeps the class's own method."""
    from minigpt.attention import MultiHeadAttention

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, context_length=24, n_layer=2, n_head=4, n_embd=32)
    model, other = GPT(config), GPT(config)
    assert speed_up_decoding(model, traceable=True)[-1] == \
        "one-query attention fused into the compiled step (2)"
    assert "_cached_attention" in vars(model.blocks[0].attn)
    assert "_cached_attention" not in vars(other.blocks[0].attn)
    assert not hasattr(MultiHeadAttention, "decode_attention")
    for block in model.blocks:  # laid out again: patched already, nothing fused twice
        block.attn.qkv = torch.nn.Linear(32, 96)
        block.attn.out_proj = torch.nn.Linear(32, 32)
    assert speed_up_decoding(model, traceable=True)[-1] == \
        "one-query attention fused into the compiled step (0)"
