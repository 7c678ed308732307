"""minigpt.cpu.loss: the chunked LM-head loss against float64 math and the plain formulation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracles import reference_cross_entropy

from minigpt.cpu.loss import linear_cross_entropy


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
    """The float32 path against float64 math."""
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


def _scaled_fp16_grads(loss_fn, h, head, targets, scale=2.0**16):
    """Gradients of ``loss_fn`` under float16 autocast with a grad-scaler-style loss scale (the
    scale only reaches the loss's terms in backward), unscaled as the scaler does."""
    h = h.detach().clone().requires_grad_()
    head.weight.grad = None
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_fn(h, head, targets)
    (loss * scale).backward()
    return [h.grad / scale, head.weight.grad / scale]


def test_fp16_training_loss_gradients_match_float32():
    """Under 16-mixed (pre-Ampere GPUs) the loss a run trains with keeps its gradients within
    0.3% of float32 at 6,144 rows. The chunked loss would not: it forms the (softmax - one-hot) / N
    terms in float16 before the loss scale arrives, deep in float16's subnormal range; that is
    why speed_up_training leaves it out under fp16 (and this test can fail)."""
    from minigpt.cpu import speed_up_training
    from minigpt.model import GPT, GPTConfig, NextTokenLoss

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=2048, context_length=1024, n_layer=1, n_head=2, n_embd=32))
    speed_up_training(model, precision="16-mixed", keep_freed_memory=False)
    assert type(model.next_token_loss) is NextTokenLoss  # the plain cross-entropy
    h = torch.randn(6, 1024, 32)  # (B, T, C): 6,144 rows
    targets = torch.randint(0, 2048, (6, 1024))
    h_ref = h.clone().requires_grad_()
    NextTokenLoss()(h_ref, model.lm_head, targets).backward()
    reference = [h_ref.grad, model.lm_head.weight.grad.clone()]

    def worst_error(grads):
        return max(float((g - r).norm() / r.norm()) for g, r in zip(grads, reference, strict=True))

    assert worst_error(_scaled_fp16_grads(model.next_token_loss, h, model.lm_head, targets)) < 3e-3

    def chunked(hidden, head, t):
        return linear_cross_entropy(hidden.flatten(0, 1), head.weight, t.flatten())

    assert worst_error(_scaled_fp16_grads(chunked, h, model.lm_head, targets)) > 3e-3


@pytest.mark.parametrize("chunk_rows", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_capped_loss_matches_float64_math(chunk_rows, dtype):
    """Logits cap * tanh(z / cap), written out in float64 here: the loss and both gradients
    through the cap (large logits, so the cap bends them)."""
    torch.manual_seed(4)
    cap = 3.0
    h = (3 * torch.randn(40, 24)).requires_grad_()
    weight = torch.randn(300, 24, requires_grad=True)
    targets = torch.randint(0, 300, (40,))
    targets[:5] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        loss = linear_cross_entropy(h, weight, targets, chunk_rows=chunk_rows, softcap=cap)
    loss.backward()
    h64, w64 = (t.detach().double().requires_grad_() for t in (h, weight))
    if dtype == torch.bfloat16:  # the matmul's operands are rounded, as autocast's would be
        h64, w64 = (t.detach().to(dtype).double().requires_grad_() for t in (h, weight))
    z = h64 @ w64.t()
    assert (z.abs() > 3 * cap).float().mean() > 0.5  # most logits well inside the tanh's bend
    expected = F.cross_entropy(cap * torch.tanh(z / cap), targets, ignore_index=-100)
    expected.backward()
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(loss.double(), expected, **tol)
    torch.testing.assert_close(h.grad.double(), h64.grad, **tol)
    torch.testing.assert_close(weight.grad.double(), w64.grad, **tol)
    uncapped = linear_cross_entropy(h, weight, targets, chunk_rows=chunk_rows)
    assert not torch.allclose(uncapped, loss, rtol=1e-2)  # the cap changed the loss
