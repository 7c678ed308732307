"""minigpt.train.optim: the LR schedule and AdamW groups, with numbers."""

import pytest

from minigpt.model import GPT, GPTConfig
from minigpt.train.optim import lr_at, param_groups

MUON = {"name": "muon", "matrix_optimizer": "torch.optim.Muon", "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 0, "decay_steps": 10,
        "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "muon_lr": 0.02,
        "muon_momentum": 0.95, "muon_weight_decay": 0.0, "muon_adjust_lr": "original"}


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


def test_warmup_stable_decay_at_its_boundaries():
    from minigpt.train.optim import wsd_lr_at

    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=100, cooldown_fraction=0.4)
    assert wsd_lr_at(0, **kw) == pytest.approx(0.1)  # warmup as cosine's
    assert wsd_lr_at(9, **kw) == pytest.approx(1.0)
    assert wsd_lr_at(10, **kw) == 1.0 and wsd_lr_at(59, **kw) == 1.0  # stable to step 60
    assert wsd_lr_at(60, **kw) == pytest.approx(1.0)  # the cooldown starts at the peak ...
    assert wsd_lr_at(80, **kw) == pytest.approx(0.55)  # ... halfway down at 80 ...
    assert wsd_lr_at(99, **kw) == pytest.approx(1.0 - 0.9 * 39 / 40)
    assert wsd_lr_at(100, **kw) == 0.1 and wsd_lr_at(10_000, **kw) == 0.1  # ... min_lr at 100
    cooldown = [wsd_lr_at(s, **kw) for s in range(60, 101)]
    assert all(a > b for a, b in zip(cooldown, cooldown[1:], strict=False))
    # a cooldown longer than what follows the warmup starts right after it
    assert wsd_lr_at(10, **{**kw, "cooldown_fraction": 1.0}) == pytest.approx(1.0)
    assert wsd_lr_at(11, **{**kw, "cooldown_fraction": 1.0}) < 1.0


def test_muon_steps_the_block_matrices_and_adamw_the_rest():
    import torch

    from minigpt.train.optim import block_matrices, build_optimizers, schedule_for

    model = GPT(GPTConfig(vocab_size=64, context_length=8, n_layer=2, n_head=2, n_embd=16))
    optim = {**MUON, "schedule": "wsd", "cooldown_fraction": 0.5, "muon_split_qkv": False}
    names = {id(p): n for n, p in model.named_parameters()}
    matrices = {names[id(p)] for p in block_matrices(model)}
    assert matrices == {f"blocks.{i}.{m}.weight" for i in range(2)
                        for m in ("attn.qkv", "attn.out_proj", "mlp.fc", "mlp.proj")}
    optimizers = build_optimizers(model, optim, fused=False)
    assert isinstance(optimizers["muon"], torch.optim.Muon)
    muon_ids = {id(p) for g in optimizers["muon"].param_groups for p in g["params"]}
    adam_ids = {id(p) for g in optimizers["optimizer"].param_groups for p in g["params"]}
    assert not muon_ids & adam_ids and len(muon_ids | adam_ids) == len(names)
    # both follow one schedule shape, each from its own peak
    schedulers = {k: schedule_for(o, optim) for k, o in optimizers.items()}
    for _ in range(6):
        for k, o in optimizers.items():
            o.step()
            schedulers[k].step()
    assert optimizers["muon"].param_groups[0]["lr"] == pytest.approx(0.02 * (1 - 0.9 * 1 / 5))
    assert optimizers["optimizer"].param_groups[0]["lr"] == pytest.approx(1e-3 * (1 - 0.9 / 5))


def test_a_matrix_optimizer_where_it_cannot_run_is_one_line():
    from minigpt.config import OptimSchema
    from minigpt.errors import ConfigError
    from minigpt.train.optim import check_optimizers_run

    muon = OptimSchema(**{**MUON, "decay_steps": 10})
    check_optimizers_run(muon, "ddp", "bf16-mixed")
    check_optimizers_run(OptimSchema(decay_steps=10), "fsdp", "16-mixed")
    with pytest.raises(ConfigError, match="optim.matrix_optimizer=torch.optim.Muon "
                       r"\(optim=muon\) does not run under trainer=fsdp.*use"):
        check_optimizers_run(muon, "fsdp", "bf16-mixed")
    with pytest.raises(ConfigError, match="trainer.precision=16-mixed.*bf16-mixed or 32-true"):
        check_optimizers_run(muon, "auto", "16-mixed")


@pytest.mark.parametrize(("path", "why"), [
    ("torch.optim.Nope", "Nope"), ("nowhere.MyOptimizer", "nowhere"),
    ("torch.nn.Linear", "not a torch.optim.Optimizer subclass")])
def test_a_bad_optimizer_class_path_is_one_line_naming_it(path, why):
    from minigpt.config import OptimSchema
    from minigpt.errors import ConfigError
    from minigpt.train.optim import check_optimizers_run

    with pytest.raises(ConfigError, match=rf"^optim.optimizer='{path}' is not an optimizer "
                       rf"class \(.*{why}.*\): give the dotted path .*torch.optim.SGD") as e:
        check_optimizers_run(OptimSchema(optimizer=path, decay_steps=10), "auto", "32-true")
    assert "\n" not in str(e.value)


def test_any_optimizer_class_gets_minigpts_groups_and_the_settings_it_takes():
    import torch

    from minigpt.train.optim import build_optimizers, param_groups

    model = GPT(GPTConfig(vocab_size=64, context_length=8, n_layer=2, n_head=2, n_embd=16))
    optim = {**MUON, "name": "sgd", "matrix_optimizer": None, "optimizer": "torch.optim.SGD",
             "optimizer_kwargs": {"momentum": 0.5, "dampening": 0.1}}
    (name, sgd), = build_optimizers(model, optim, fused=False).items()
    assert name == "sgd" and type(sgd) is torch.optim.SGD  # no betas or eps: SGD takes none
    expected = param_groups(model, 0.1)
    assert [len(g["params"]) for g in sgd.param_groups] == [len(g["params"]) for g in expected]
    assert [g["weight_decay"] for g in sgd.param_groups] == [0.1, 0.0]
    assert {(g["lr"], g["momentum"], g["dampening"]) for g in sgd.param_groups} == \
        {(1e-3, 0.5, 0.1)}
    # one class for both roles: the matrices' optimizer is saved under a name of its own
    both = build_optimizers(model, {**MUON, "matrix_optimizer": "torch.optim.AdamW",
                                    "matrix_kwargs": {"amsgrad": True}}, fused=False)
    assert set(both) == {"optimizer", "matrix_optimizer"}
    assert both["matrix_optimizer"].param_groups[0]["amsgrad"] is True
    assert both["matrix_optimizer"].param_groups[0]["weight_decay"] == 0.0  # muon_weight_decay


def test_an_untied_head_is_not_decayed():
    model = GPT(GPTConfig(vocab_size=64, context_length=8, n_layer=1, n_head=2, n_embd=16,
                          tie_head=False))
    decay, _ = param_groups(model, 0.1)
    assert id(model.lm_head.weight) not in {id(p) for p in decay["params"]}
    assert len(decay["params"]) == 4  # qkv, out_proj, fc, proj


def test_embeddings_and_an_untied_head_take_their_own_learning_rates():
    import torch

    from minigpt.train.optim import schedule_for

    model = GPT(GPTConfig(vocab_size=64, context_length=8, n_layer=1, n_head=2, n_embd=16,
                          tie_head=False))
    groups = param_groups(model, 0.1, embedding_lr=0.5, head_lr=0.03)
    names = {id(p): n for n, p in model.named_parameters()}
    assert [sorted(names[id(p)] for p in g["params"]) for g in groups[2:]] == [
        ["pos_emb.weight", "tok_emb.weight"], ["lm_head.weight"]]
    assert [(g["lr"], g["weight_decay"]) for g in groups[2:]] == [(0.5, 0.0), (0.03, 0.0)]
    assert sum(p.numel() for g in groups for p in g["params"]) == model.num_params()
    optim = dict(lr=2e-3, min_lr=2e-4, warmup_steps=2, decay_steps=10, schedule="cosine")
    optimizer = torch.optim.AdamW(groups, lr=optim["lr"])
    scheduler = schedule_for(optimizer, optim)
    for _ in range(10):
        optimizer.step(), scheduler.step()
    # every group ends at min_lr's fraction (1/10) of its own peak
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([2e-4, 2e-4, 0.05, 0.003])
    assert len(param_groups(model, 0.1)) == 2  # unset: the two groups older checkpoints hold
    tied = GPT(GPTConfig(vocab_size=64, context_length=8, n_layer=1, n_head=2, n_embd=16))
    groups = param_groups(tied, 0.1, embedding_lr=0.5)
    assert len(groups) == 3 and id(tied.lm_head.weight) in {id(p) for p in groups[2]["params"]}


def test_split_qkv_muon_steps_queries_keys_and_values_as_three_matrices():
    """Oracle: torch.optim.Muon over three separate matrices holding the same numbers."""
    import torch

    from minigpt.train.optim import build_optimizers

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, context_length=8, n_layer=1, n_head=4, n_embd=16,
                          num_kv_heads=2))  # q rows 16, k and v rows 8 each
    optim = {**MUON, "muon_weight_decay": 0.01, "muon_split_qkv": True}
    optimizers = build_optimizers(model, optim, fused=False)
    weight = model.blocks[0].attn.qkv.weight
    parts = [torch.nn.Parameter(weight.detach()[rows].clone())
             for rows in (slice(0, 16), slice(16, 24), slice(24, 32))]
    oracle = torch.optim.Muon(parts, lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True,
                              adjust_lr_fn="original")
    fused_oracle = torch.optim.Muon([torch.nn.Parameter(weight.detach().clone())], lr=0.02,
                                    weight_decay=0.01, momentum=0.95, nesterov=True)
    idx = torch.randint(0, 64, (2, 8))
    for _ in range(2):  # the second step uses the momentum the first one left
        model.loss(idx, idx).backward()
        for part, rows in zip(parts, (slice(0, 16), slice(16, 24), slice(24, 32)), strict=True):
            part.grad = weight.grad[rows].clone()
        fused_oracle.param_groups[0]["params"][0].grad = weight.grad.clone()
        for optimizer in (*optimizers.values(), oracle, fused_oracle):
            optimizer.step()
        assert weight.grad is None  # dropped: the next step accumulates afresh
        torch.testing.assert_close(weight.detach(), torch.cat([p.detach() for p in parts]))
        for optimizer in optimizers.values():
            optimizer.zero_grad(set_to_none=True)
    fused = fused_oracle.param_groups[0]["params"][0].detach()
    assert not torch.allclose(weight.detach(), fused, atol=1e-4)  # fused is another update
    adam_ids = {id(p) for g in optimizers["optimizer"].param_groups for p in g["params"]}
    assert id(weight) not in adam_ids
    state = optimizers["muon"].state_dict()  # plain tensors, one momentum per view
    assert [s["momentum_buffer"].shape for s in state["state"].values()][:3] == [
        (16, 16), (8, 16), (8, 16)]


def test_value_embeddings_are_embeddings_to_the_optimizers():
    """Lookup tables, like the token embedding: in AdamW's embedding group (undecayed, at
    embedding_lr), never among Muon's matrices."""
    from minigpt.train.optim import build_optimizers

    model = GPT(GPTConfig(vocab_size=64, context_length=8, n_layer=3, n_head=2, n_embd=16,
                          value_embeddings=True))
    names = {id(p): n for n, p in model.named_parameters()}
    groups = param_groups(model, 0.1, embedding_lr=0.5)
    assert sorted(names[id(p)] for p in groups[2]["params"]) == [
        "pos_emb.weight", "tok_emb.weight", "value_embeds.0.weight", "value_embeds.2.weight"]
    optimizers = build_optimizers(model, {**MUON, "embedding_lr": 0.5, "muon_split_qkv": True},
                                  fused=False)
    muon = {names.get(id(p), "a qkv view") for g in optimizers["muon"].param_groups
            for p in g["params"]}
    assert not any("value_embeds" in n for n in muon)
