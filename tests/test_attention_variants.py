"""The attention variants (grouped-query, rotary, sliding window): the invariants of the GPT-2
block for each, and each against an independent reference written here."""

from __future__ import annotations

import math

import pytest
import torch

import minigpt.window
from minigpt.attention import KVCache, MultiHeadAttention

# name -> keyword arguments at 4 heads of 4 dims (d_out=16)
VARIANTS = {
    "gpt2": {},
    "gqa": {"num_kv_heads": 2},
    "mqa": {"num_kv_heads": 1},
    "rope": {"rope": True},
    "window": {"window": 3},
    "rope_window": {"rope": True, "window": 3},
    "mqa_rope_window": {"num_kv_heads": 1, "rope": True, "window": 4},
}
variants = pytest.mark.parametrize("name", list(VARIANTS))


def make(name: str, context_length: int = 12, dropout: float = 0.0, seed: int = 0,
         **overrides) -> MultiHeadAttention:
    torch.manual_seed(seed)
    kwargs = {**VARIANTS[name], **overrides}
    return MultiHeadAttention(8, 16, context_length, dropout, 4, qkv_bias=True, **kwargs).eval()


def new_cache(attn: MultiHeadAttention, batch: int, capacity: int) -> KVCache:
    """What GPT.new_kv_cache gives such a layer: a ring of `window` slots for a window."""
    return KVCache(batch, 1, attn.num_kv_heads, capacity if attn.window is None else attn.window,
                   attn.head_dim, window=attn.window)


# --- independent references ----------------------------------------------------------------------


def reference(attn: MultiHeadAttention, x, padding=None, positions=None):
    """Attention written out plainly in float64: the three projections from qkv's rows, every kv
    head repeated for its group of query heads, rotation by explicit 2x2 matrices, the causal
    (and banded) mask as a loop-built matrix, softmax by hand."""
    B, T, _ = x.shape
    nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    W, b = attn.qkv.weight.double(), attn.qkv.bias.double()
    out = x.double() @ W.t() + b
    q = out[..., : nh * hd].view(B, T, nh, hd).transpose(1, 2)
    k = out[..., nh * hd : (nh + nkv) * hd].view(B, T, nkv, hd).transpose(1, 2)
    v = out[..., (nh + nkv) * hd :].view(B, T, nkv, hd).transpose(1, 2)
    group = nh // nkv
    k = torch.stack([k[:, h // group] for h in range(nh)], 1)  # (B, nh, T, hd)
    v = torch.stack([v[:, h // group] for h in range(nh)], 1)
    if attn.rope_theta is not None:
        pos = torch.arange(T) if positions is None else positions
        q, k = rotate_by_hand(q, pos, attn.rope_theta), rotate_by_hand(k, pos, attn.rope_theta)
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        for j in range(i + 1):
            allowed[i, j] = attn.window is None or i - j < attn.window
    allowed = allowed.expand(B, 1, T, T)
    if padding is not None:
        allowed = allowed & ~padding[:, None, None, :]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
    y = (weights @ v).transpose(1, 2).reshape(B, T, nh * hd)
    return (y @ attn.out_proj.weight.double().t() + attn.out_proj.bias.double()).float()


def rotate_by_hand(x, positions, theta):
    """Rotate each pair (x[i], x[i + hd/2]) at position m by m * theta^(-2i/hd), one pair at a
    time, with a 2x2 rotation matrix."""
    hd = x.shape[-1]
    out = x.clone()
    for t, m in enumerate(positions.tolist()):
        for i in range(hd // 2):
            angle = m * theta ** (-2 * i / hd)
            rot = torch.tensor([[math.cos(angle), -math.sin(angle)],
                                [math.sin(angle), math.cos(angle)]], dtype=x.dtype)
            pair = torch.stack([x[..., t, i], x[..., t, i + hd // 2]], -1)  # (B, h, 2)
            rotated = pair @ rot.t()
            out[..., t, i], out[..., t, i + hd // 2] = rotated[..., 0], rotated[..., 1]
    return out


@variants
@pytest.mark.parametrize("T", [1, 5, 12])
def test_equals_the_plain_reference(name, T):
    attn = make(name)
    x = torch.randn(2, T, 8)
    torch.testing.assert_close(attn(x), reference(attn, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [2, 3, 128])
@pytest.mark.parametrize("window,T", [(1, 7), (3, 10), (4, 13), (5, 5)])
def test_banded_chunks_equal_an_explicit_band(monkeypatch, chunk, window, T):
    """Chunk lengths below, at and above the window; T not a multiple of the chunk."""
    monkeypatch.setattr(minigpt.window, "CHUNK", chunk)
    attn = make("window", context_length=16, window=window)
    x = torch.randn(2, T, 8)
    pad = torch.zeros(2, T, dtype=torch.bool)
    pad[1, :3] = True
    torch.testing.assert_close(attn(x), reference(attn, x), rtol=1e-5, atol=1e-5)
    y = attn(x, key_padding_mask=pad)
    torch.testing.assert_close(y[~pad], reference(attn, x, pad)[~pad], rtol=1e-5, atol=1e-5)


def test_grouped_query_equals_multi_head_with_repeated_kv_heads():
    gqa = make("gqa")
    mha = make("gpt2")
    hd, C = gqa.head_dim, gqa.d_out
    q_rows, k_rows, v_rows = gqa.qkv.weight.split([C, 2 * hd, 2 * hd])
    qb, kb, vb = gqa.qkv.bias.split([C, 2 * hd, 2 * hd])

    def repeat(t):  # kv head j serves query heads 2j and 2j + 1
        return t.view(2, hd, *t.shape[1:]).repeat_interleave(2, 0).reshape(4 * hd, *t.shape[1:])

    with torch.no_grad():
        mha.qkv.weight.copy_(torch.cat([q_rows, repeat(k_rows), repeat(v_rows)]))
        mha.qkv.bias.copy_(torch.cat([qb, repeat(kb), repeat(vb)]))
        mha.out_proj.load_state_dict(gqa.out_proj.state_dict())
    x = torch.randn(3, 9, 8)
    torch.testing.assert_close(gqa(x), mha(x), rtol=1e-5, atol=1e-6)
    assert gqa.qkv.weight.shape == (16 + 2 * 2 * 4, 8)  # the projection shrinks


def test_rope_depends_on_relative_positions_only():
    attn = make("rope")
    x = torch.randn(1, 6, 8)
    shifted = torch.arange(100, 106)[None]
    torch.testing.assert_close(attn(x, position_ids=shifted), attn(x), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(attn(x, position_ids=shifted),
                               reference(attn, x, positions=shifted[0]), rtol=1e-4, atol=1e-5)


# --- the GPT-2 block's invariants, for every variant --------------------------------------------


@variants
@pytest.mark.parametrize("t", [0, 4, 10])
def test_future_tokens_do_not_change_the_past(name, t):
    attn = make(name)
    x = torch.randn(2, 12, 8)
    changed = x.clone()
    changed[:, t + 1:] += 5 * torch.randn(2, 11 - t, 8)
    torch.testing.assert_close(attn(x)[:, : t + 1], attn(changed)[:, : t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(attn(x)[:, t + 1:], attn(changed)[:, t + 1:])


@variants
def test_padded_keys_carry_no_weight(name):
    attn = make(name)
    x = torch.randn(2, 8, 8)
    pad = torch.zeros(2, 8, dtype=torch.bool)
    pad[0, 1] = pad[1, 0] = True
    changed = x.clone()
    changed[0, 1] += 10.0
    changed[1, 0] -= 10.0
    y, y_changed = attn(x, key_padding_mask=pad), attn(changed, key_padding_mask=pad)
    torch.testing.assert_close(y[~pad], y_changed[~pad], rtol=0, atol=1e-6)


@variants
def test_all_masked_rows_are_finite(name):
    attn = make(name)
    x = torch.randn(2, 6, 8)
    pad = torch.tensor([[True, True, False, False, False, False], [True] * 6])
    y = attn(x, key_padding_mask=pad)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y[0, 0], attn.out_proj.bias)  # nothing visible: out_proj(0)
    assert torch.isfinite(attn.attention_weights(x, key_padding_mask=pad)).all()


@variants
def test_dropout_only_in_training(name):
    attn = make(name, dropout=0.5)
    x = torch.randn(2, 12, 8)
    attn.train()
    assert not torch.allclose(attn(x), attn(x))
    attn.eval()
    torch.testing.assert_close(attn(x), attn(x), rtol=0, atol=0)
    torch.testing.assert_close(attn(x), reference(attn, x), rtol=1e-5, atol=1e-5)


@variants
def test_attention_weights_reproduce_forward(name):
    attn = make(name)
    x = torch.randn(2, 10, 8)
    w = attn.attention_weights(x)  # (B, nh, T, T)
    assert (w.triu(1) == 0).all()
    if attn.window is not None:
        assert (w.tril(-attn.window) == 0).all()
    _, _, v = attn._project(x, None, None)
    v = v.repeat_interleave(attn.num_heads // attn.num_kv_heads, 1)
    out = attn.out_proj((w @ v).transpose(1, 2).reshape(2, 10, 16))
    torch.testing.assert_close(out, attn(x), rtol=1e-5, atol=1e-6)


@variants
@pytest.mark.parametrize("chunks", [[12], [1] * 12, [5, 1, 1, 4, 1], [2, 7, 3]])
def test_kv_cache_in_chunks_equals_one_full_pass(name, chunks):
    attn = make(name)
    x = torch.randn(2, 12, 8)
    cache = new_cache(attn, 2, 12)
    outputs, start = [], 0
    for n in chunks:
        outputs.append(attn(x[:, start : start + n], kv_cache=cache.layers[0]))
        start += n
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(outputs, 1), attn(x), rtol=1e-5, atol=1e-6)


@variants
def test_left_padded_cached_row_equals_the_row_alone(name):
    attn = make(name)
    x = torch.randn(1, 7, 8)
    padded = torch.cat([torch.randn(1, 3, 8), x], dim=1)  # 3 pads, then the 7 real tokens
    pad = torch.tensor([[True] * 3 + [False] * 7])
    positions = (torch.arange(10) - 3).clamp(min=0)[None]  # each row's first real token at 0
    cache = new_cache(attn, 1, 10)
    prefix = attn(padded[:, :6], key_padding_mask=pad[:, :6], kv_cache=cache.layers[0],
                  position_ids=positions[:, :6])
    rest = [attn(padded[:, i : i + 1], kv_cache=cache.layers[0], position_ids=positions[:, i : i + 1])
            for i in range(6, 10)]
    y = torch.cat([prefix, *rest], dim=1)[:, 3:]
    torch.testing.assert_close(y, attn(x), rtol=1e-5, atol=1e-6)


@variants
def test_no_t_by_t_mask_on_the_causal_path(name, monkeypatch):
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        seen.append((attn_mask, is_causal))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    T = 32
    make(name, context_length=T)(torch.randn(2, T, 8))
    ((mask, is_causal),) = seen
    if VARIANTS[name].get("window") is None:
        assert mask is None and is_causal
    else:  # the band's chunks: (B * chunks, 1, C, W + C), far smaller than (T, T)
        assert mask.shape[-1] < T and mask.numel() < T * T


# --- the ring buffer ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["rope_window", "mqa_rope_window"])
def test_ring_cache_decodes_far_past_its_size_and_context(name):
    """Rope + window runs past context_length: decoding 40 tokens one at a time through a
    4-slot ring equals one pass over all 40 (bands) and the reference."""
    attn = make(name, context_length=8)
    x = torch.randn(2, 40, 8)
    cache = new_cache(attn, 2, 8)
    nbytes = cache.nbytes
    first = attn(x[:, :5], kv_cache=cache.layers[0])
    steps = [attn(x[:, i : i + 1], kv_cache=cache.layers[0]) for i in range(5, 33)]
    last = attn(x[:, 33:], kv_cache=cache.layers[0])  # a chunk after the ring has wrapped
    y = torch.cat([first, *steps, last], 1)
    assert cache.length == 40 and cache.nbytes == nbytes and cache.capacity == attn.window
    torch.testing.assert_close(y, attn(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y, reference(attn, x), rtol=1e-5, atol=1e-5)


def test_ring_cache_refuses_full_attention():
    attn = make("gpt2")
    ring = KVCache(1, 1, 4, 4, 4, window=4)
    with pytest.raises(ValueError, match="built for window=4, the layer attends with window=None"):
        attn(torch.randn(1, 2, 8), kv_cache=ring.layers[0])
    with pytest.raises(ValueError, match="holds at most 4 tokens, got capacity=8; give capacity=4"):
        KVCache(1, 1, 4, 8, 4, window=4)


def test_bounded_variants_still_refuse_more_than_the_context():
    for name in ("gqa", "rope", "window"):
        with pytest.raises(ValueError, match="13 tokens exceed context_length=12"):
            make(name)(torch.randn(1, 13, 8))


# --- honest errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"num_kv_heads": 3}, r"^num_kv_heads=3 must divide num_heads=4$"),
    ({"num_kv_heads": 0}, r"^num_kv_heads=0 must be an integer in \[1, num_heads=4\]$"),
    ({"num_kv_heads": 8}, r"^num_kv_heads=8 must be an integer in \[1, num_heads=4\]$"),
    ({"window": 0}, r"^window=0 must be a positive integer \(or null for full causal attention\)$"),
    ({"d_out": 24, "num_heads": 8, "rope": True}, r"^rope needs an even head dimension, got head_dim=3$"),
])
def test_bad_variant_values_are_one_line_errors(kwargs, message):
    args = {"d_in": 8, "d_out": 16, "context_length": 8, "dropout": 0.0, "num_heads": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention(**args)
