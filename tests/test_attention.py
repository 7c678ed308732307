"""MultiHeadAttention: masking and shapes first, then equality with the book's unfused class."""

import itertools

import pytest
import torch
from oracles import BookMultiHeadAttention
from torch import nn

from minigpt.attention import MultiHeadAttention


def make_pair(d_in=12, d_out=16, context_length=10, num_heads=4, qkv_bias=False, seed=0):
    torch.manual_seed(seed)
    book = BookMultiHeadAttention(d_in, d_out, context_length, 0.0, num_heads, qkv_bias).eval()
    ours = MultiHeadAttention(d_in, d_out, context_length, 0.0, num_heads, qkv_bias).eval()
    ours.load_state_dict(book.state_dict())
    return book, ours


# --- masking -------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [0, 1, 4, 8])
def test_causal_future_tokens_do_not_change_the_past(t):
    torch.manual_seed(1)
    attn = MultiHeadAttention(8, 8, context_length=10, dropout=0.0, num_heads=2).eval()
    x = torch.randn(2, 10, 8)
    x_changed = x.clone()
    x_changed[:, t + 1 :] = torch.randn(2, 10 - t - 1, 8) * 5
    y, y_changed = attn(x), attn(x_changed)
    torch.testing.assert_close(y[:, : t + 1], y_changed[:, : t + 1], rtol=0, atol=1e-6)
    if t + 1 < 10:  # and the change is visible later, so the check above can fail
        assert not torch.allclose(y[:, t + 1 :], y_changed[:, t + 1 :])


def test_key_padding_changing_a_padded_token_changes_nothing_elsewhere():
    torch.manual_seed(2)
    attn = MultiHeadAttention(8, 8, context_length=6, dropout=0.0, num_heads=2).eval()
    x = torch.randn(2, 6, 8)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[0, 1] = True  # a padded token in the middle of row 0
    pad[1, 0] = True  # and a left pad in row 1
    x_changed = x.clone()
    x_changed[0, 1] += 10.0
    x_changed[1, 0] -= 10.0
    y, y_changed = attn(x, key_padding_mask=pad), attn(x_changed, key_padding_mask=pad)
    keep = ~pad
    torch.testing.assert_close(y[keep], y_changed[keep], rtol=0, atol=1e-6)
    # without the mask the same change leaks into later positions
    assert not torch.allclose(attn(x)[0, 2:], attn(x_changed)[0, 2:])


def test_key_padding_equals_dropping_the_padded_tokens():
    """A left-padded row gives the real tokens the outputs they get with no padding at all."""
    book, ours = make_pair(d_in=8, d_out=8, context_length=8, num_heads=2)
    x = torch.randn(1, 5, 8)
    padded = torch.cat([torch.randn(1, 3, 8), x], dim=1)
    pad = torch.tensor([[True] * 3 + [False] * 5])
    torch.testing.assert_close(ours(padded, key_padding_mask=pad)[:, 3:], book(x), rtol=0,
                               atol=1e-6)


def test_query_with_all_keys_masked_is_finite():
    attn = MultiHeadAttention(8, 8, context_length=4, dropout=0.0, num_heads=2).eval()
    x = torch.randn(2, 4, 8)
    pad = torch.tensor([[True, True, False, False], [True, True, True, True]])
    y = attn(x, key_padding_mask=pad)
    assert torch.isfinite(y).all()
    # row 0, query 0 sees only key 0 (padding): its mixed value is zero, so out = out_proj(0)
    torch.testing.assert_close(y[0, 0], attn.out_proj.bias)
    weights = attn.attention_weights(x, key_padding_mask=pad)
    assert torch.isfinite(weights).all()


def test_attention_weights_are_causal_rows_sum_to_one_and_skip_padding():
    torch.manual_seed(3)
    attn = MultiHeadAttention(8, 8, context_length=6, dropout=0.0, num_heads=2).eval()
    x = torch.randn(2, 6, 8)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, :2] = True
    w = attn.attention_weights(x, key_padding_mask=pad)
    assert w.shape == (2, 2, 6, 6)
    above = torch.ones(6, 6, dtype=torch.bool).triu(1)
    assert (w[..., above] == 0).all()
    torch.testing.assert_close(w[0].sum(-1), torch.ones(2, 6))
    torch.testing.assert_close(w[1, :, 2:].sum(-1), torch.ones(2, 4))
    assert (w[1, :, :, :2] == 0).all()


def test_attention_weights_reproduce_forward():
    torch.manual_seed(4)
    attn = MultiHeadAttention(8, 12, context_length=6, dropout=0.0, num_heads=3).eval()
    x = torch.randn(2, 5, 8)
    w = attn.attention_weights(x)  # (B, nh, T, T)
    v = attn.qkv(x)[..., 24:].view(2, 5, 3, 4).transpose(1, 2)
    out = attn.out_proj((w @ v).transpose(1, 2).reshape(2, 5, 12))
    torch.testing.assert_close(out, attn(x), rtol=0, atol=1e-6)


# --- shapes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "d_in,d_out,num_heads,tokens",
    list(itertools.product([3, 16], [8, 24], [1, 2, 4], [1, 5, 12])),
)
def test_shapes_and_equality_over_a_grid(d_in, d_out, num_heads, tokens):
    book, ours = make_pair(d_in, d_out, context_length=12, num_heads=num_heads, seed=tokens)
    x = torch.randn(3, tokens, d_in)
    y = ours(x)
    assert y.shape == (3, tokens, d_out)
    torch.testing.assert_close(y, book(x), rtol=0, atol=1e-6)


# --- the book's numbers and state dict ---------------------------------------------------


@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 7, 32])
def test_equals_book_class_for_the_same_weights(qkv_bias, tokens):
    book, ours = make_pair(d_in=24, d_out=32, context_length=32, num_heads=4, qkv_bias=qkv_bias)
    x = torch.randn(4, tokens, 24)
    diff = (ours(x) - book(x)).abs().max().item()
    assert diff <= 1e-6, diff


def test_book_example_numbers():
    """The chapter's six-token example: (2 batches, 6 tokens, 3 dims) -> d_out=2, 2 heads."""
    torch.manual_seed(123)
    inputs = torch.tensor(
        [[0.43, 0.15, 0.89], [0.55, 0.87, 0.66], [0.57, 0.85, 0.64],
         [0.22, 0.58, 0.33], [0.77, 0.25, 0.10], [0.05, 0.80, 0.55]]
    )
    batch = torch.stack((inputs, inputs))
    book = BookMultiHeadAttention(3, 2, 6, 0.0, num_heads=2)
    ours = MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)
    ours.load_state_dict(book.state_dict())
    torch.testing.assert_close(ours(batch), book(batch), rtol=0, atol=1e-6)
    assert ours(batch).shape == (2, 6, 2)


def test_loading_the_book_state_dict_fuses_in_q_k_v_order():
    book, ours = make_pair(qkv_bias=True)
    d = book.W_query.weight.shape[0]
    torch.testing.assert_close(ours.qkv.weight[:d], book.W_query.weight)
    torch.testing.assert_close(ours.qkv.weight[d : 2 * d], book.W_key.weight)
    torch.testing.assert_close(ours.qkv.weight[2 * d :], book.W_value.weight)
    torch.testing.assert_close(ours.qkv.bias[2 * d :], book.W_value.bias)
    assert "mask" not in ours.state_dict()
    assert not any(b.numel() >= 100 for b in ours.buffers())  # no T x T mask kept


def test_book_state_dict_loads_inside_a_bigger_model():
    book = nn.Sequential(BookMultiHeadAttention(8, 8, 4, 0.0, 2))
    ours = nn.Sequential(MultiHeadAttention(8, 8, 4, 0.0, 2))
    result = ours.load_state_dict(book.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys


def test_our_state_dict_round_trips():
    _, ours = make_pair()
    fresh = MultiHeadAttention(12, 16, 10, 0.0, 4)
    fresh.load_state_dict(ours.state_dict())
    x = torch.randn(2, 10, 12)
    torch.testing.assert_close(fresh.eval()(x), ours(x))


def test_incomplete_book_state_dict_is_rejected():
    book, ours = make_pair()
    state = book.state_dict()
    del state["W_key.weight"]
    with pytest.raises(KeyError, match="W_key.weight"):
        ours.load_state_dict(state)


# --- dropout --------------------------------------------------------------------------------


def test_dropout_only_in_training_mode():
    torch.manual_seed(5)
    attn = MultiHeadAttention(8, 8, context_length=8, dropout=0.5, num_heads=2)
    x = torch.randn(2, 8, 8)
    attn.train()
    assert not torch.allclose(attn(x), attn(x))  # two different dropout masks
    attn.eval()
    torch.testing.assert_close(attn(x), attn(x), rtol=0, atol=0)
    book = BookMultiHeadAttention(8, 8, 8, 0.5, 2).eval()
    book.load_state_dict({**attn.state_dict(), **_unfuse(attn)}, strict=False)
    torch.testing.assert_close(attn(x), book(x), rtol=0, atol=1e-6)


def _unfuse(attn):
    q, k, v = attn.qkv.weight.chunk(3)
    return {"W_query.weight": q, "W_key.weight": k, "W_value.weight": v}


# --- bad input ------------------------------------------------------------------------------


def test_d_out_not_divisible_by_num_heads():
    with pytest.raises(ValueError, match=r"d_out=10 must be divisible by num_heads=4"):
        MultiHeadAttention(8, 10, 16, 0.0, 4)


@pytest.mark.parametrize("shape", [(4, 8), (2, 4, 8, 1), (2, 4, 7)])
def test_x_with_wrong_shape(shape):
    attn = MultiHeadAttention(8, 8, 16, 0.0, 2)
    with pytest.raises(ValueError, match=r"d_in=8.*got \(" + ", ".join(map(str, shape))):
        attn(torch.randn(*shape))


def test_more_tokens_than_context_length():
    attn = MultiHeadAttention(8, 8, 16, 0.0, 2)
    with pytest.raises(ValueError, match=r"17 tokens exceed context_length=16"):
        attn(torch.randn(1, 17, 8))


@pytest.mark.parametrize("mask_shape", [(2, 5), (1, 6), (2, 6, 1)])
def test_mask_with_wrong_shape(mask_shape):
    attn = MultiHeadAttention(8, 8, 16, 0.0, 2)
    with pytest.raises(ValueError, match=r"\(2, 6\).*got"):
        attn(torch.randn(2, 6, 8), key_padding_mask=torch.zeros(mask_shape, dtype=torch.bool))


def test_mask_must_be_bool():
    attn = MultiHeadAttention(8, 8, 16, 0.0, 2)
    with pytest.raises(ValueError, match="must be bool"):
        attn(torch.randn(2, 6, 8), key_padding_mask=torch.zeros(2, 6))


@pytest.mark.parametrize(
    "kwargs,message",
    [({"num_heads": 0}, "num_heads=0"), ({"dropout": 1.5}, "dropout=1.5"),
     ({"context_length": -1}, "context_length=-1")],
)
def test_bad_constructor_values(kwargs, message):
    args = {"d_in": 8, "d_out": 8, "context_length": 4, "dropout": 0.0, "num_heads": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention(**args)


# --- the causal fast path builds no mask ------------------------------------------------------


def test_causal_path_passes_no_mask_to_sdpa(monkeypatch):
    seen = {}
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        seen.update(attn_mask=attn_mask, is_causal=is_causal)
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    attn = MultiHeadAttention(8, 8, 16, 0.0, 2)
    attn(torch.randn(2, 16, 8))
    assert seen == {"attn_mask": None, "is_causal": True}


# --- KV cache ---------------------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [[10], [1] * 10, [4, 1, 1, 3, 1], [3, 7]])
def test_kv_cache_in_chunks_equals_one_full_pass(chunks):
    from minigpt.attention import KVCache

    torch.manual_seed(6)
    attn = MultiHeadAttention(8, 12, context_length=10, dropout=0.0, num_heads=3).eval()
    x = torch.randn(2, 10, 8)
    cache = KVCache(2, 1, 3, 10, 4)  # batch, layers, kv heads, capacity, head dim
    outputs, start = [], 0
    for n in chunks:
        outputs.append(attn(x[:, start : start + n], kv_cache=cache.layers[0]))
        start += n
    assert cache.length == 10
    torch.testing.assert_close(torch.cat(outputs, 1), attn(x), rtol=0, atol=1e-6)


def test_kv_cache_with_left_padding_equals_the_unpadded_row():
    from minigpt.attention import KVCache

    book, ours = make_pair(d_in=8, d_out=8, context_length=8, num_heads=2)
    x = torch.randn(1, 6, 8)
    padded = torch.cat([torch.randn(1, 2, 8), x], dim=1)  # 2 pads, then the 6 real tokens
    pad = torch.tensor([[True, True] + [False] * 6])
    cache = KVCache(1, 1, 2, 8, 4)
    prefix = ours(padded[:, :5], key_padding_mask=pad[:, :5], kv_cache=cache.layers[0])
    rest = [ours(padded[:, i : i + 1], key_padding_mask=pad[:, i : i + 1], kv_cache=cache.layers[0])
            for i in range(5, 8)]
    y = torch.cat([prefix, *rest], dim=1)[:, 2:]
    torch.testing.assert_close(y, book(x), rtol=0, atol=1e-6)


def test_kv_cache_overflow_is_a_clear_error():
    from minigpt.attention import KVCache

    attn = MultiHeadAttention(8, 8, context_length=16, dropout=0.0, num_heads=2)
    cache = KVCache(1, 1, 2, 4, 4)
    attn(torch.randn(1, 4, 8), kv_cache=cache.layers[0])
    with pytest.raises(ValueError, match="KV cache holds 4 tokens but 5"):
        attn(torch.randn(1, 1, 8), kv_cache=cache.layers[0])
