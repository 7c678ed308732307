"""minigpt.train.optim: the LR schedule and AdamW groups, with numbers."""

import pytest

from minigpt.model import GPT, GPTConfig
from minigpt.train.optim import lr_at, param_groups


def test_lr_schedule_numbers():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(4, **kw) == pytest.approx(0.5)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0)  # cosine starts at the peak
    assert lr_at(60, **kw) == pytest.approx(0.55)  # halfway: (lr + min_lr) / 2
    assert lr_at(110, **kw) == pytest.approx(0.1)
    assert lr_at(10_000, **kw) == pytest.approx(0.1)
    decay = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))


def test_param_groups_decay_linear_weights_only():
    model = GPT(GPTConfig(vocab_size=64, context_length=8, n_layer=2, n_head=2, n_embd=16))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    # qkv, out_proj, fc, proj in each of 2 blocks; the LM head is the (undecayed) embedding
    assert len(decayed) == 8 and all(n.endswith(".weight") and "norm" not in n for n in decayed)
    undecayed = {names[id(p)] for p in no_decay["params"]}
    assert {"tok_emb.weight", "pos_emb.weight", "final_norm.weight", "final_norm.bias"} <= undecayed
    assert not any("lm_head" in n for n in decayed)
    total = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert total == model.num_params()
