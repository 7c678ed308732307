"""The scorer: a context run once before its continuations (KV cache, left-padded) gives the
numbers of each ``context + continuation`` row run whole; rows cut from the left as promised."""

from __future__ import annotations

import pytest
import torch

from minigpt.eval.scoring import fit_row, score_groups, score_pairs, score_rows
from minigpt.model import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def model_of(**variant):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=97, context_length=24, n_layer=2, n_head=2, n_embd=32,
                         init_std=0.3, **variant)).eval()


def groups_of(seed=0):
    g = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(97, (n,), generator=g).tolist()

    # contexts of different lengths, 1 to 4 continuations, some of one token
    return [(tokens(c), [tokens(n) for n in ends]) for c, ends in
            [(5, [3, 1, 7, 2]), (12, [4, 4]), (1, [9, 1, 3]), (17, [8]), (8, [1, 2, 3, 6])]]


@pytest.mark.parametrize("variant", [{}, {"position": "rope"}, {"num_kv_heads": 1}],
                         ids=["gpt2", "rope", "mqa"])
@pytest.mark.parametrize("batch_size", [1, 5, 64])
def test_groups_equal_whole_rows(variant, batch_size):
    model, groups = model_of(**variant), groups_of()
    rows = [(ctx + cont, len(cont)) for ctx, conts in groups for cont in conts]
    whole = score_rows(model, rows, batch_size=3)
    shared = [s for g in score_groups(model, groups, batch_size=batch_size) for s in g]
    torch.testing.assert_close([s.logprob for s in shared], [s.logprob for s in whole],
                               rtol=0, atol=1e-4)
    assert [(s.tokens, s.greedy) for s in shared] == [(s.tokens, s.greedy) for s in whole]


@pytest.mark.parametrize("variant", [{}, {"position": "rope", "window": 8}], ids=["gpt2", "window"])
def test_pairs_share_contexts_and_cut_what_does_not_fit(variant):
    model, groups = model_of(**variant), groups_of()
    pairs = [(ctx, cont) for ctx, conts in groups for cont in conts]
    pairs += [(list(range(30)), [1, 2, 3]), ([], [4, 5, 6]), (list(range(20)), [7] * 6)]
    scores, cut = score_pairs(model, pairs, batch_size=4)
    rows = [fit_row(ctx, cont, 24)[:2] for ctx, cont in pairs]
    whole = score_rows(model, rows, batch_size=4)
    torch.testing.assert_close([s.logprob for s in scores], [s.logprob for s in whole],
                               rtol=0, atol=1e-4)
    assert cut == [False] * (len(pairs) - 3) + [True, False, True]
    assert [s.tokens for s in scores[-3:]] == [3, 2, 6]  # an empty context: the first is not scored


def test_whole_rows_equal_one_sequence_at_a_time():
    model = model_of()
    row = list(range(10, 30))
    logp = torch.log_softmax(model(torch.tensor([row[:-1]]))[0], dim=-1)  # (19, V)
    expected = sum(logp[t, row[t + 1]].item() for t in range(12, 19))
    (score,) = score_rows(model, [(row, 7)], batch_size=1)
    assert score.logprob == pytest.approx(expected, abs=1e-4) and score.tokens == 7


def test_fit_row_cuts_from_the_left():
    assert fit_row([1, 2, 3], [4, 5], context_length=8) == ([1, 2, 3, 4, 5], 2, False)
    assert fit_row([1, 2, 3], [4, 5], context_length=3) == ([2, 3, 4, 5], 2, True)
    assert fit_row([1], [2, 3, 4, 5], context_length=2) == ([3, 4, 5], 2, True)


def test_bad_groups_and_rows():
    model = model_of()
    with pytest.raises(ValueError, match="run past context_length=24: cut them with fit_row"):
        score_groups(model, [(list(range(20)), [[1] * 6])], batch_size=4)
    with pytest.raises(ValueError, match="needs a context and continuations"):
        score_groups(model, [([], [[1]])], batch_size=4)
    with pytest.raises(ValueError, match="sliding-window model's cache"):
        score_groups(model_of(position="rope", window=8), [([1], [[2]])], batch_size=4)
    with pytest.raises(ValueError, match="batch_size=0 must be at least 1"):
        score_rows(model, [([1, 2], 1)], batch_size=0)
    with pytest.raises(ValueError, match="row 0 has 2 tokens and 2 to score"):
        score_rows(model, [([1, 2], 2)], batch_size=1)
