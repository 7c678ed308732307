"""The window schedule (``GPTConfig.window_schedule``, ``minigpt.window``): the window of each
step as numbers, the rules named, each step's attention against the formula GPT with that step's
window (``tests.oracles``), and a compiled model that runs on through a window change without
recompiling (torch._dynamo's ``error_on_recompile``)."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from oracles import ref_logits

from minigpt.model import GPT, GPTConfig
from minigpt.window import follow_window_schedule, scheduled_window

SCHEDULE = [4, 8, 16]


def tiny(**fields) -> GPTConfig:
    return GPTConfig(**{"vocab_size": 64, "context_length": 16, "n_layer": 2, "n_head": 2,
                        "n_embd": 32, **fields})


def test_each_window_takes_an_equal_share_of_the_steps():
    assert [scheduled_window([128, 256, 384, 512], s, 8) for s in range(8)] == \
        [128, 128, 256, 256, 384, 384, 512, 512]
    assert [scheduled_window(SCHEDULE, s, 7) for s in range(9)] == [4, 4, 4, 8, 8, 16, 16, 16, 16]
    assert scheduled_window([512], 0, 1) == 512


@pytest.mark.parametrize("schedule, window, match", [
    ([8, 4, 16], None, r"window_schedule=\[8, 4, 16\] must not shrink"),
    ([4, 8], None, r"must end at the full context_length=16 .* append 16"),
    ([0, 16], None, r"window_schedule=\[0, 16\] must be a list of positive integers"),
    ([], None, r"window_schedule=\[\] must be a list"),
    ("4,16", None, r"window_schedule='4,16' must be a list"),
    ([4.0, 16], None, r"must be a list of positive integers"),
    ([8, 16], 4, r"so window=4 must be null"),
])
def test_a_bad_schedule_is_named_with_the_fix(schedule, window, match):
    with pytest.raises(ValueError, match=match):
        tiny(window_schedule=schedule, window=window)


def oracle_with_window(model: GPT, window: int):
    """The formula GPT (``tests.oracles``) reading ``model``'s weights with a fixed ``window``."""
    config = dataclasses.replace(model.config, window=window, window_schedule=None)
    return types.SimpleNamespace(config=config, state_dict=model.state_dict)


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_each_steps_attention_is_the_formula_gpt_with_that_steps_window(position):
    torch.manual_seed(0)
    model = GPT(tiny(window_schedule=SCHEDULE, position=position)).eval()
    idx = torch.randint(0, 64, (2, 16))
    seen = []
    for step in range(6):
        window = follow_window_schedule(model, step, 6)
        seen.append(window)
        torch.testing.assert_close(model(idx), ref_logits(oracle_with_window(model, window), idx),
                                   atol=1e-5, rtol=1e-5)
    assert seen == [4, 4, 8, 8, 16, 16]
    # the windows differ: a short window's logits are not the full context's
    follow_window_schedule(model, 0, 6)
    assert not torch.allclose(model(idx), ref_logits(oracle_with_window(model, 16), idx),
                              atol=1e-3)


def test_the_schedule_adds_no_state_dict_keys_and_starts_at_the_full_context():
    plain, scheduled = GPT(tiny()), GPT(tiny(window_schedule=SCHEDULE))
    assert list(plain.state_dict()) == list(scheduled.state_dict())
    scheduled.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 64, (2, 16))
    # a model loaded for decoding attends to the full context, as the schedule's last window
    torch.testing.assert_close(scheduled(idx), plain(idx))
    assert follow_window_schedule(plain, 0, 6) is None


def test_a_packed_row_under_the_schedule_is_the_fixed_window_document_mask():
    """Document mask and schedule compose: a packed row's logits with the step's window are the
    logits of a document-mask model with that fixed window (itself checked against documents
    run alone in tests/test_documents.py)."""
    torch.manual_seed(0)
    model = GPT(tiny(window_schedule=SCHEDULE, document_mask=True)).eval()
    idx = torch.randint(0, 64, (2, 16))
    document_ids = torch.tensor([[0] * 10 + [1] * 6, [0] * 3 + [1] * 13])
    for step in range(3):
        window = follow_window_schedule(model, step, 3)
        fixed = GPT(tiny(window=window, document_mask=True)).eval()
        fixed.load_state_dict(model.state_dict())
        torch.testing.assert_close(model(idx, document_ids=document_ids),
                                   fixed(idx, document_ids=document_ids))


def train_steps(model: GPT, forward, steps: int, idx: torch.Tensor) -> list[float]:
    """``steps`` SGD steps of ``forward`` (the model or its compiled form) under the schedule."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        follow_window_schedule(model, step, steps)
        loss = forward(idx[:, :-1], idx[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_compiled_model_trains_through_window_changes_without_recompiling():
    idx = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    eager = GPT(tiny(window_schedule=SCHEDULE))
    torch.manual_seed(0)
    model = GPT(tiny(window_schedule=SCHEDULE))
    torch._dynamo.reset()
    compiled = torch.compile(model.loss, backend="aot_eager", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        losses = train_steps(model, compiled, 6, idx)  # windows 4, 4, 8, 8, 16, 16
    assert losses == pytest.approx(train_steps(eager, eager.loss, 6, idx), rel=1e-5)


def test_the_recompile_check_would_catch_a_window_held_as_an_int():
    """The control: the same check fails when the window is a Python int that changes (both
    windows at least the row, so the same plain causal path runs)."""
    model = GPT(tiny(window=16))
    idx = torch.randint(0, 64, (2, 16))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled(idx)
        for layer in model.attention_layers():
            layer.window = 20
        with pytest.raises(Exception, match="[Rr]ecompil"):
            compiled(idx)


def test_flex_attention_takes_the_scheduled_window_as_a_tensor():
    """The CUDA path (FlexAttention's block mask, its mask_mod closing over the window tensor),
    run through flex_attention's reference implementation on the CPU, equals the CPU path
    (SDPA under the dense document mask) with the same window as an int."""
    from minigpt.documents import document_attention, flex_document_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 32, 8, generator=g) for _ in range(3))
    document_ids = torch.tensor([[0] * 20 + [1] * 12, [0] * 5 + [1] * 27])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for window in (4, 16, 32):
        expected = document_attention(q, k, v, document_ids, window, None, 0.0, sdpa)
        got = flex_document_attention(q, k, v, document_ids, torch.tensor(window), None,
                                      compiled=False)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
