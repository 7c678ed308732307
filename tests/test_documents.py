"""Document masking (minigpt.documents): a packed row of documents gives each document the
logits, loss and gradients it gets run alone (the oracle), for every attention variant and the
modern block options; positions restart at each document; errors name the fix."""

from __future__ import annotations

import pytest
import torch

from minigpt.attention import MultiHeadAttention
from minigpt.documents import (
    document_attention,
    document_ids_of,
    document_mask,
    document_positions,
    flex_document_attention,
)
from minigpt.model import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")

BOS = 0
VARIANTS = {  # GPTConfig fields at 2 heads
    "gpt2": {},
    "rope": {"position": "rope"},
    "window": {"window": 4},
    "rope_window": {"position": "rope", "window": 4},
    "gqa": {"num_kv_heads": 1},
    "modern": {"position": "rope", "norm": "rmsnorm", "qk_norm": True, "mlp": "relu2",
               "tie_head": False, "logit_softcap": 15.0, "value_embeddings": True, "window": 6,
               "num_kv_heads": 1},
}
# document lengths of two packed rows of 24 tokens; each row's first document has no BOS (the
# tail of one that began in an earlier row), the others begin with it
ROWS = ([5, 9, 3, 7], [11, 2, 1, 10])
T = 24


def tiny(name: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=37, context_length=32, n_layer=2, n_head=2, n_embd=32,
                          document_mask=True, **VARIANTS[name]))
    if not model.config.tie_head:  # zero-initialized: give the head numbers to compare
        torch.nn.init.normal_(model.lm_head.weight, std=0.02)
    return model


def packed_documents(generator: torch.Generator) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """Each row's documents (ids 1..36, BOS first but in a row's first one) and the rows."""
    rows = []
    for lengths in ROWS:
        docs = [torch.randint(1, 37, (n,), generator=generator) for n in lengths]
        for doc in docs[1:]:
            doc[0] = BOS
        rows.append(docs)
    return rows, torch.stack([torch.cat(docs) for docs in rows])


def targets_for(docs: list[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
    return [torch.randint(0, 37, doc.shape, generator=generator) for doc in docs]


def gradients(model: GPT) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_packed_row_equals_each_document_alone(name):
    model = tiny(name)
    g = torch.Generator().manual_seed(1)
    rows, idx = packed_documents(g)
    targets = [targets_for(docs, g) for docs in rows]
    packed_targets = torch.stack([torch.cat(t) for t in targets])
    ids = document_ids_of(idx, BOS)

    logits = model(idx, document_ids=ids)  # (B, T, V)
    (model.loss(idx, packed_targets, document_ids=ids) * idx.numel()).backward()
    packed_grads = gradients(model)
    packed_loss = model.loss(idx, packed_targets, document_ids=ids).item()

    model.zero_grad()
    total, start_logits = 0.0, []
    for docs, doc_targets in zip(rows, targets, strict=True):
        alone = []
        for doc, target in zip(docs, doc_targets, strict=True):
            alone.append(model(doc[None])[0])
            loss = model.loss(doc[None], target[None]) * len(doc)
            loss.backward()  # gradients add up over the documents
            total += loss.item()
        start_logits.append(torch.cat(alone))
    torch.testing.assert_close(logits, torch.stack(start_logits), atol=1e-5, rtol=0)
    assert packed_loss == pytest.approx(total / idx.numel(), abs=1e-5)
    alone_grads = gradients(model)
    assert alone_grads.keys() == packed_grads.keys()
    for key, grad in packed_grads.items():
        torch.testing.assert_close(grad, alone_grads[key], atol=1e-5, rtol=0, msg=key)


def test_the_mask_changes_what_a_packed_row_computes():
    """Without document_ids the same row attends across documents: the oracle above can fail."""
    model = tiny("gpt2")
    _, idx = packed_documents(torch.Generator().manual_seed(1))
    masked = model(idx, document_ids=document_ids_of(idx, BOS))
    assert (model(idx) - masked).abs().max() > 1e-3


def test_document_positions_restart_at_each_document():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [3, 3, 3, 3, 5, 3]])
    expected = torch.tensor([[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 0, 0]])
    torch.testing.assert_close(document_positions(ids), expected)
    idx = torch.tensor([[4, BOS, 7, 7, BOS, 2]])
    torch.testing.assert_close(document_ids_of(idx, BOS), torch.tensor([[0, 1, 1, 1, 2, 2]]))


def test_mask_is_causal_block_diagonal_and_windowed():
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0]])  # two runs of id 0 are two documents
    mask = document_mask(ids, window=2)[0, 0].long()
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0, 0, 0],
        [0, 0, 0, 1, 0, 0, 0, 0],
        [0, 0, 0, 1, 1, 0, 0, 0],
        [0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 1],
    ])
    torch.testing.assert_close(mask, expected)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window, kv_heads", [(None, 2), (3, 1)])
def test_flex_attention_path_matches_the_sdpa_path(window, kv_heads):
    """The CUDA kernel's rule, run here through flex_attention's reference implementation."""
    torch.manual_seed(0)
    q = torch.randn(2, 2, 16, 8)
    k, v = torch.randn(2, kv_heads, 16, 8), torch.randn(2, kv_heads, 16, 8)
    ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])
    padding = torch.zeros(2, 16, dtype=torch.bool)
    padding[1, 12:] = True
    attention = MultiHeadAttention(16, 16, 16, 0.0, 2, num_kv_heads=kv_heads)
    dense = document_attention(q, k, v, ids, window, padding, 0.0, attention._sdpa)
    flex = flex_document_attention(q, k, v, ids, window, padding, compiled=False)
    torch.testing.assert_close(flex[:, :, :12], dense[:, :, :12], atol=1e-5, rtol=0)
    torch.testing.assert_close(flex[0], dense[0], atol=1e-5, rtol=0)


def test_padding_composes_with_documents():
    """A padded key carries no weight in its document: changing it changes nothing."""
    torch.manual_seed(0)
    attention = MultiHeadAttention(16, 16, 16, 0.0, 2).eval()
    x = torch.randn(1, 10, 16)
    ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1]])
    padding = torch.zeros(1, 10, dtype=torch.bool)
    padding[0, 5] = True
    y = attention(x, padding, document_ids=ids)
    x2 = x.clone()
    x2[0, 5] += 3.0
    y2 = attention(x2, padding, document_ids=ids)
    keep = [i for i in range(10) if i != 5]
    torch.testing.assert_close(y[:, keep], y2[:, keep])


def test_errors_name_the_fix():
    model = tiny("gpt2")
    idx = torch.randint(1, 37, (1, 6))
    ids = torch.zeros(1, 6, dtype=torch.long)
    plain = GPT(GPTConfig(vocab_size=37, context_length=32, n_layer=1, n_head=2, n_embd=32))
    with pytest.raises(ValueError, match="document_mask=false; set model.document_mask=true"):
        plain(idx, document_ids=ids)
    with pytest.raises(ValueError, match=r"document_ids must be an integer tensor of shape "
                                         r"\(batch, tokens\)=\(1, 6\), got \(1, 5\)"):
        model(idx, document_ids=ids[:, :5])
    with pytest.raises(ValueError, match="decoding is one document; pass document_ids=None"):
        model.blocks[0].attn(torch.randn(1, 6, 32), kv_cache=model.new_kv_cache(1).layers[0],
                             document_ids=ids)


def test_decoding_is_unchanged_by_the_flag():
    """document_mask=true changes no weight and no decoding: the same weights without it
    generate the same tokens."""
    model = tiny("rope").eval()
    plain = GPT(GPTConfig(**{**model.config.to_dict(), "document_mask": False})).eval()
    plain.load_state_dict(model.state_dict())
    prompt = torch.randint(1, 37, (1, 5))
    torch.testing.assert_close(model.generate(prompt, 6, top_k=1), plain.generate(prompt, 6, top_k=1))
    assert GPTConfig().document_mask is False


def test_compiled_block_mask_equals_the_eager_one_and_compiles_once():
    """The block mask CUDA training builds (compiled) has the tiles and the rule of the eager
    build for every batch, window and padding, from one graph per window: a new batch of ids
    never recompiles."""
    from torch._dynamo.utils import counters

    from minigpt.documents import _block_mask, _compiled_block_mask

    T, generator = 384, torch.Generator().manual_seed(0)  # 3 x 3 tiles of 128
    graphs_before = counters["stats"]["unique_graphs"]
    for batch in range(3):
        ids = (torch.rand(2, T, generator=generator) < 0.01).cumsum(1)  # documents of ~100
        padding = torch.zeros(2, T, dtype=torch.bool)
        padding[1, T - 50 * batch:] = True
        for window in (None, torch.tensor(160)):
            eager = _block_mask(ids, window, padding, T, torch.device("cpu"))
            compiled = _compiled_block_mask()(ids, window, padding, T, torch.device("cpu"))
            assert torch.equal(compiled.to_dense(), eager.to_dense())
            assert torch.equal(compiled.kv_num_blocks, eager.kv_num_blocks)
            assert torch.equal(compiled.full_kv_num_blocks, eager.full_kv_num_blocks)
            q = torch.arange(T)[:, None]
            rule = document_mask(ids, window, padding)[1, 0]  # one row's (T, T) rule, token level
            assert torch.equal(compiled.mask_mod(torch.tensor(1), torch.tensor(0), q,
                                                 torch.arange(T)[None]), rule)
    assert counters["stats"]["unique_graphs"] - graphs_before <= 2  # None and a tensor window
