"""minigpt.cpu.linear: the oneDNN float32 path gives nn.Linear's numbers (against float64 math)
and is taken exactly where it should be."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minigpt.cpu import onednn
from minigpt.cpu.linear import (
    MATMULS,
    TIMED_ROWS,
    OneDNNLinear,
    linear,
    timed_shape,
    train_key,
    uses_onednn,
    weight_grad,
)

needs_onednn = pytest.mark.skipif(not onednn.available(), reason="PyTorch built without oneDNN")


def Linear(d_in, d_out, bias=True):  # noqa: N802 (reads like the class it builds)
    return OneDNNLinear.like(nn.Linear(d_in, d_out, bias=bias))


def float64_linear_grads(x, weight, bias, grad_y):
    """Output and gradients of x @ weight.T + bias, in float64 with plain autograd (the oracle)."""
    leaves = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    y = leaves[0] @ leaves[1].t() + leaves[2]
    y.backward(grad_y.double())
    return y.detach(), *(t.grad for t in leaves)


@needs_onednn
@pytest.mark.parametrize("shape", [(2, 16, 24, 40), (3, 50, 96, 8), (1, 64, 8, 96), (40, 1, 5, 7)])
def test_output_and_gradients_match_float64(shape):
    """(batch, tokens, in, out): 3-D inputs, and out/in shapes that take either form of the
    weight gradient (weight_grad picks the one that copies less)."""
    B, T, d_in, d_out = shape
    torch.manual_seed(0)
    layer = Linear(d_in, d_out)
    x = torch.randn(B, T, d_in, requires_grad=True)
    grad_y = torch.randn(B, T, d_out)
    assert uses_onednn(x, layer.weight)
    y = layer(x)
    y.backward(grad_y)
    expected = float64_linear_grads(x, layer.weight, layer.bias, grad_y)
    got = (y, x.grad, layer.weight.grad, layer.bias.grad)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == torch.float32 and g.shape == e.shape
        torch.testing.assert_close(g.double(), e, rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("n, d_in, d_out", [(64, 8, 96), (64, 96, 8)])
def test_weight_grad_both_forms(n, d_in, d_out):
    torch.manual_seed(1)
    grad_rows, rows = torch.randn(n, d_out), torch.randn(n, d_in)
    expected = grad_rows.double().t() @ rows.double()
    torch.testing.assert_close(weight_grad(grad_rows, rows).double(), expected, rtol=1e-5,
                               atol=1e-5)


@needs_onednn
def test_gradients_accumulate_over_backward_passes():
    torch.manual_seed(2)
    layer = Linear(8, 96, bias=False)  # out >> in: the transposed weight-gradient form
    x1, x2 = torch.randn(64, 8), torch.randn(64, 8)
    layer(x1).sum().backward()
    layer(x2).sum().backward()
    expected = torch.ones(64, 96).double().t() @ (x1 + x2).double()
    torch.testing.assert_close(layer.weight.grad.double(), expected, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_no_grad_path_gives_the_same_output():
    torch.manual_seed(4)
    layer = Linear(16, 24)
    x = torch.randn(2, 20, 16)
    with torch.no_grad():
        fast = layer(x)
    expected = x.double() @ layer.weight.double().t() + layer.bias.double()
    assert fast.shape == (2, 20, 24) and not fast.requires_grad
    torch.testing.assert_close(fast.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast, layer(x).detach(), rtol=0, atol=0)


def test_frozen_input_and_weight_get_no_gradient():
    layer = Linear(16, 32)
    layer.weight.requires_grad_(False)
    x = torch.randn(4, 16, 16, requires_grad=True)
    layer(x).sum().backward()
    assert layer.weight.grad is None and layer.bias.grad is not None and x.grad is not None


def test_is_an_nn_linear_with_its_state_dict():
    layer = Linear(4, 6)
    assert isinstance(layer, nn.Linear)
    assert set(layer.state_dict()) == {"weight", "bias"}
    plain = nn.Linear(4, 6)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(10, 4)
    torch.testing.assert_close(layer(x), plain(x))


@needs_onednn
def test_onednn_only_where_it_applies():
    weight = torch.randn(32, 16)
    rows = torch.randn(64, 16)
    assert uses_onednn(rows, weight)
    assert not uses_onednn(rows[:4], weight)  # decoding-sized: a few rows
    assert not uses_onednn(rows.double(), weight.double())
    assert not uses_onednn(rows.bfloat16(), weight.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not uses_onednn(rows, weight)
        assert linear(rows, weight).dtype == torch.bfloat16  # autocast's F.linear


def test_fallback_equals_f_linear_exactly():
    x, weight, bias = torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)  # 3 rows: F.linear
    assert torch.equal(linear(x, weight, bias), F.linear(x, weight, bias))


def test_like_shares_the_parameters_of_the_layer_it_replaces():
    plain = nn.Linear(16, 24)
    fast = OneDNNLinear.like(plain)
    assert fast.weight is plain.weight and fast.bias is plain.bias
    assert fast.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(32, 16)
    torch.testing.assert_close(fast(x), plain(x), rtol=1e-5, atol=1e-5)


def test_a_wide_layer_is_timed_at_its_full_width():
    """The LM head's input gradient sums over all its outputs: timing a slice of them can rank
    the kernels the other way round, so every matmul is timed at the layer's own width."""
    head = nn.Linear(768, 50304, bias=False, device="meta")
    assert {timed_shape(head, op) for op in MATMULS} == {
        (TIMED_ROWS, 768, 50304, op) for op in MATMULS}
    assert train_key(head, "input grad") == "train float32 512x768x50304 input grad"
