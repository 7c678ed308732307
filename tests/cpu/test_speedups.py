"""minigpt.cpu.speed_up_training: the sped-up model computes the plain model's loss and
gradients (within float32 rounding), keeps its parameters, tied weights and state-dict keys."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import minigpt.cpu.loss
from minigpt.cpu import speed_up_training
from minigpt.cpu.loss import ChunkedNextTokenLoss
from minigpt.model import GPT, GPTConfig, NextTokenLoss

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = dict(vocab_size=97, context_length=16, n_layer=2, n_head=2, n_embd=32)


def plain_and_fast(**kwargs):
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**TINY))
    fast = copy.deepcopy(plain)
    applied = speed_up_training(fast, keep_freed_memory=False, **kwargs)
    return plain, fast, applied


def batch():
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 97, (2, 16), generator=g)
    targets = torch.randint(0, 97, (2, 16), generator=g)
    targets[0, :3] = -100  # ignored
    return idx, targets


@pytest.mark.parametrize("chunk_rows", [None, 5])  # 5: several chunks, the last one short
def test_loss_and_gradients_equal_the_plain_model(chunk_rows, monkeypatch):
    if chunk_rows:
        monkeypatch.setattr(minigpt.cpu.loss, "_CHUNK_ELEMENTS", chunk_rows * TINY["vocab_size"])
    plain, fast, applied = plain_and_fast()
    assert applied == ["chunked LM-head loss"]
    assert all(type(m) is nn.Linear for m in fast.modules() if isinstance(m, nn.Linear))
    idx, targets = batch()
    expected = plain.loss(idx, targets)
    loss = fast.loss(idx, targets)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    expected_grads = torch.autograd.grad(expected, list(plain.parameters()))
    grads = torch.autograd.grad(loss, list(fast.parameters()))
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(fast(idx), plain(idx), rtol=1e-5, atol=1e-5)


def test_parameters_tying_and_state_dict_keys_are_kept():
    plain, fast, _ = plain_and_fast()
    params = {id(p) for p in fast.parameters()}
    assert speed_up_training(fast, keep_freed_memory=False) == []  # nothing applied twice
    assert {id(p) for p in fast.parameters()} == params
    assert fast.lm_head.weight is fast.tok_emb.weight
    assert list(fast.state_dict()) == list(plain.state_dict())
    assert isinstance(fast.next_token_loss, ChunkedNextTokenLoss)


def test_loss_under_bfloat16_autocast_matches_the_plain_model():
    plain, fast, _ = plain_and_fast(precision="bf16-mixed")
    idx, targets = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, loss = plain.loss(idx, targets), fast.loss(idx, targets)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=1e-3, atol=1e-3)
    loss.backward()
    assert fast.tok_emb.weight.grad.dtype == torch.float32


def test_nothing_model_level_when_compiled_or_off_the_cpu():
    _, fast, applied = plain_and_fast(compiled=True)
    assert applied == []
    assert type(fast.blocks[0].attn.qkv) is nn.Linear and type(fast.next_token_loss) is NextTokenLoss
    meta = GPT(GPTConfig(**TINY)).to("meta")
    assert speed_up_training(meta) == []


def test_float16_keeps_the_plain_loss():
    _, fast, applied = plain_and_fast(precision="16-mixed")
    assert "chunked LM-head loss" not in applied
    assert type(fast.next_token_loss) is NextTokenLoss


MODERN = dict(TINY, norm="rmsnorm", qk_norm=True, position="rope", mlp="relu2", tie_head=False,
              logit_softcap=15.0, value_embeddings=True)
UNFUSED = "norm=rmsnorm, qk_norm, position=rope, mlp=relu2"


def modern_plain_and_fast(monkeypatch=None, works=True, **options):
    if monkeypatch is not None:
        monkeypatch.setattr(minigpt.cpu.blocks, "compiler_works", lambda: works)
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**dict(MODERN, **options)))
    with torch.no_grad():  # the zero-initialized head would give every parameter a zero grad
        plain.lm_head.weight.normal_(std=0.02)
    fast = copy.deepcopy(plain)
    return plain, fast, speed_up_training(fast, keep_freed_memory=False)


def test_unfused_blocks_train_through_a_compiled_forward_with_the_plain_numbers():
    plain, fast, applied = modern_plain_and_fast()
    assert applied[0] == f"compiled blocks ({UNFUSED}) (2)"
    assert applied[-1] == "chunked LM-head loss"  # soft-capped (minigpt.cpu.loss)
    assert fast.next_token_loss.logit_softcap == 15.0
    assert type(fast.blocks[0].attn.qkv) is nn.Linear  # the compiler picks the block's kernels
    params = {id(p) for p in fast.parameters()}
    assert speed_up_training(fast, keep_freed_memory=False) == []  # nothing swapped twice
    assert {id(p) for p in fast.parameters()} == params
    assert list(fast.state_dict()) == list(plain.state_dict())
    idx, targets = batch()
    expected, loss = plain.loss(idx, targets), fast.loss(idx, targets)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    expected_grads = torch.autograd.grad(expected, list(plain.parameters()))
    grads = torch.autograd.grad(loss, list(fast.parameters()))
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
    assert all(g.abs().sum() > 0 for g in grads)  # the comparison is not of zeros


def test_compiled_blocks_decode_eagerly_as_the_plain_model():
    plain, fast, _ = modern_plain_and_fast()
    plain.eval(), fast.eval()
    idx, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(fast(idx), plain(idx), rtol=1e-5, atol=1e-5)
        cache = fast.new_kv_cache(batch_size=2, capacity=16)
        first = fast(idx[:, :10], kv_cache=cache)
        step = fast(idx[:, 10:11], kv_cache=cache)
        torch.testing.assert_close(torch.cat([first, step], 1), plain(idx[:, :11]),
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("works, window, why", [
    (False, None, "torch.compile found no C++ compiler"),
    (True, 8, "window: not compiled"),
])
def test_unfused_blocks_stay_eager_without_a_compiler_or_with_a_window(works, window, why,
                                                                       monkeypatch):
    _, fast, applied = modern_plain_and_fast(monkeypatch, works=works, window=window)
    assert applied[0] == f"eager blocks ({UNFUSED}; {why})"
    assert not minigpt.cpu.blocks.is_compiled_for_training(fast.blocks[0])


def test_gpt2_blocks_are_not_compiled():
    _, fast, applied = plain_and_fast()
    assert not any("blocks" in line for line in applied)
    assert not minigpt.cpu.blocks.is_compiled_for_training(fast.blocks[0])
