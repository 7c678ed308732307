"""minigpt.cpu.loss: the chunked LM-head loss against float64 math and the plain formulation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minigpt.cpu.loss import linear_cross_entropy, reference_cross_entropy


def test_linear_cross_entropy_with_huge_logits_stays_exact():
    """Targets whose softmax probability underflows float32 still get the exact loss."""
    torch.manual_seed(0)
    h = (200 * torch.randn(40, 8)).requires_grad_()
    weight = torch.randn(30, 8, requires_grad=True)
    targets = torch.randint(0, 30, (40,))
    loss = linear_cross_entropy(h, weight, targets, chunk_rows=7)
    reference = reference_cross_entropy(h, weight, targets)
    assert reference.item() > 100  # far beyond -log(smallest float32)
    torch.testing.assert_close(loss, reference)
    for g, e in zip(torch.autograd.grad(loss, [h, weight]),
                    torch.autograd.grad(reference, [h, weight]), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("chunk_rows", [None, 7])
def test_linear_cross_entropy_matches_float64(chunk_rows):
    """The float32 path (oneDNN's GEMMs on the CPU, see minigpt.cpu.linear) against float64 math."""
    torch.manual_seed(3)
    h = torch.randn(40, 24, requires_grad=True)
    weight = torch.randn(300, 24, requires_grad=True)
    targets = torch.randint(0, 300, (40,))
    targets[:5] = -100
    loss = linear_cross_entropy(h, weight, targets, chunk_rows=chunk_rows)
    loss.backward()
    h64, w64 = (t.detach().double().requires_grad_() for t in (h, weight))
    expected = F.cross_entropy(h64 @ w64.t(), targets, ignore_index=-100)
    expected.backward()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-5, atol=1e-7)
