"""Conversations as training rows: ids and targets by hand, counts of what was dropped, zero
gradient from prompt tokens, and a packed row's loss equal to its conversations' losses alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minigpt.chat.template import ChatTemplate
from minigpt.data.chat import IGNORE_INDEX, pack_rows, train_on_all
from minigpt.documents import document_ids_of
from minigpt.model import GPT, GPTConfig
from minigpt.tokenizer import CharTokenizer

X = IGNORE_INDEX  # an ignored target
F_, T_ = False, True
# BOS 9, then a 3-token prompt and a 2-token reply (the mask marks the reply)
A = ([9, 1, 2, 3, 4, 5], [F_, F_, F_, F_, T_, T_])
B = ([9, 6, 7], [F_, F_, T_])


def test_packed_rows_by_hand():
    x, y, report = pack_rows([A, B, A], context_length=9, pad_id=9)
    assert x.tolist() == [[9, 1, 2, 3, 4, 5, 9, 6, 7], [9, 1, 2, 3, 4, 5, 9, 9, 9]]
    assert y.tolist() == [[X, X, X, 4, 5, X, X, 7, X], [X, X, X, 4, 5, X, X, X, X]]
    assert (report.conversations, report.rows, report.trained) == (3, 2, 5)


def test_padded_rows_and_train_on_all():
    x, y, _ = pack_rows([B, (A[0], train_on_all(A[1]))], context_length=5, pad_id=0,
                        rows="padded", too_long="truncate")
    assert x.tolist() == [[9, 6, 7, 0, 0], [9, 1, 2, 3, 4]]
    assert y.tolist() == [[X, 7, X, X, X], [1, 2, 3, 4, 5]]


def test_too_long_and_untrained_conversations_are_counted():
    untrained = ([9, 1, 2], [F_, F_, F_])
    x, _, report = pack_rows([A, B, untrained], context_length=4, pad_id=0)
    assert x.tolist() == [[9, 6, 7, 0]]
    assert (report.too_long, report.untrained, report.conversations) == (1, 1, 1)
    assert "1 longer than a row dropped" in report.describe("train", 5)
    _, y, report = pack_rows([A], context_length=4, pad_id=0, too_long="truncate")
    assert y.tolist() == [[X, X, X, 4]] and report.too_long == 1  # the reply's first token kept
    assert "truncated" in report.describe("train", 5)


def tiny_model(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=16, context_length=32, n_layer=2, n_head=2, n_embd=32,
                         **kw)).eval()


def test_prompt_tokens_get_exactly_zero_gradient():
    model = tiny_model()
    x, y, _ = pack_rows([A, B], context_length=9, pad_id=9)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    hidden = {}
    model.final_norm.register_forward_hook(lambda m, i, out: hidden.update(h=out) or
                                           out.retain_grad())
    model.loss(x, y).backward()
    grad = hidden["h"].grad[0].abs().sum(dim=-1)  # (T,): the gradient reaching each position
    trained = y[0] != IGNORE_INDEX
    assert torch.all(grad[~trained] == 0)
    assert torch.all(grad[trained] > 0)


def alone_loss_sum(model: GPT, ids: list[int], mask: list[bool]) -> torch.Tensor:
    """The oracle: one conversation in its own row, summed by F.cross_entropy."""
    logits = model(torch.tensor([ids[:-1]]))  # (1, L-1, V)
    targets = torch.tensor([t if m else IGNORE_INDEX for t, m in zip(ids[1:], mask[1:],
                                                                     strict=True)])
    return F.cross_entropy(logits[0].float(), targets, reduction="sum")


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_packed_row_loss_equals_the_conversations_alone(position):
    model = tiny_model(document_mask=True, position=position)
    template = ChatTemplate.for_tokenizer(CharTokenizer("abcdefghij"))  # BOS 10, specials 11..14
    conversations = [template.render(m) for m in (
        [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "de"}],
        [{"role": "system", "content": "j"}, {"role": "user", "content": "f"},
         {"role": "assistant", "content": "gh"}, {"role": "user", "content": "i"},
         {"role": "assistant", "content": "a"}])]
    x, y, report = pack_rows(conversations, context_length=32, pad_id=template.bos_id)
    assert report.rows == 1
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    with torch.no_grad():
        packed = model.loss(x, y, document_ids=document_ids_of(x, template.bos_id))
        packed_sum = packed * (y != IGNORE_INDEX).sum()
        alone = sum(alone_loss_sum(model, ids, mask) for ids, mask in conversations)
    torch.testing.assert_close(packed_sum, alone, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the oracle can tell: without the document mask they differ
        unmasked = model.loss(x, y) * (y != IGNORE_INDEX).sum()
    assert abs(float(unmasked - alone)) > 1e-3  # 100x the tolerance above
