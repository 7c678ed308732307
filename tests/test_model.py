"""GPTConfig and GPT: shapes, tied weights, initialization, loss at init, overfitting, sizes."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from minigpt.model import GPT, GPTConfig

TINY = dict(vocab_size=97, context_length=16, n_layer=2, n_head=2, n_embd=32)


def tiny(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**TINY, **overrides}))


# --- shapes --------------------------------------------------------------------------------------


@pytest.mark.parametrize("B, T", [(1, 1), (2, 7), (3, 16)])
def test_logits_shape(B, T):
    model = tiny().eval()
    idx = torch.randint(0, 97, (B, T))
    assert model(idx).shape == (B, T, 97)
    assert model(idx, last_only=True).shape == (B, 1, 97)
    torch.testing.assert_close(model(idx, last_only=True), model(idx)[:, -1:])


def test_bad_input_raises_named_errors():
    model = tiny()
    with pytest.raises(ValueError, match=r"17 tokens exceed context_length=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"idx must have shape \(batch, tokens\), got \(5,\)"):
        model(torch.zeros(5, dtype=torch.long))


# --- tied weights --------------------------------------------------------------------------------


def test_lm_head_is_tied_to_token_embedding_and_stays_tied():
    model = tiny()
    assert model.lm_head.weight is model.tok_emb.weight
    idx = torch.randint(0, 50, (2, 16))  # tokens >= 50 never appear in the input...
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = F.cross_entropy(model(idx).flatten(0, 1), idx.roll(-1, 1).flatten())
    loss.backward()
    # ... so their embedding rows get gradient only through the LM head: one tensor, both paths.
    assert model.tok_emb.weight.grad[50:].abs().sum() > 0
    before = model.tok_emb.weight.detach().clone()
    optimizer.step()
    assert model.lm_head.weight is model.tok_emb.weight
    assert not torch.equal(model.tok_emb.weight, before)
    assert sum(p is model.tok_emb.weight for p in model.parameters()) == 1


# --- initialization ------------------------------------------------------------------------------


def test_gpt2_initialization():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=1024, context_length=256, n_layer=4, n_head=4, n_embd=256)
    model = GPT(config)
    residual_std = 0.02 / math.sqrt(2 * config.n_layer)
    for name, p in model.named_parameters():
        if name.endswith(("attn.out_proj.weight", "mlp.proj.weight")):
            assert p.std().item() == pytest.approx(residual_std, rel=0.03), name
        elif name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == (
                "final_norm.weight"):
            assert torch.all(p == 1), name
        elif name.endswith("bias"):
            assert torch.all(p == 0), name
        else:  # embeddings, qkv, fc
            assert p.std().item() == pytest.approx(0.02, rel=0.03), name
            assert abs(p.mean().item()) < 1e-3, name


def test_loss_at_init_is_about_ln_vocab():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, context_length=64, n_layer=2, n_head=2, n_embd=64))
    idx = torch.randint(0, 512, (8, 65))
    with torch.no_grad():
        logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
    assert loss.item() == pytest.approx(math.log(512), abs=0.1)


@pytest.fixture
def one_thread():
    """Tiny matmuls run faster on one thread, and much faster when other processes share the
    cores (idle OpenMP workers spin)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_one_small_batch_overfits(one_thread):
    torch.manual_seed(0)
    model = tiny(vocab_size=64)
    data = torch.randint(0, 64, (4, 17))
    x, y = data[:, :-1], data[:, 1:]  # (4, 16) each
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(100):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05  # from ln(64) = 4.16


# --- sizes and FLOPs -----------------------------------------------------------------------------

GPT2_SIZES = {  # (n_layer, n_head, n_embd) -> parameters with tied weights (as transformers)
    "gpt2": ((12, 12, 768), 124_439_808),
    "gpt2-medium": ((24, 16, 1024), 354_823_168),
    "gpt2-large": ((36, 20, 1280), 774_030_080),
    "gpt2-xl": ((48, 25, 1600), 1_557_611_200),
}


@pytest.mark.parametrize("name", GPT2_SIZES)
def test_gpt2_parameter_counts_on_meta_device(name):
    (n_layer, n_head, n_embd), expected = GPT2_SIZES[name]
    with torch.device("meta"):  # shapes only: no memory, no init work
        model = GPT(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd))
    assert model.num_params() == expected
    assert model.num_params(include_position=False) == expected - 1024 * n_embd
    if name == "gpt2":
        assert round(model.num_params() / 1e6, 1) == 124.4


def test_flops_per_token_by_hand():
    V, T, L, C = 97, 16, 2, 32
    model = tiny()
    per_block = 2 * C + (3 * C * C + 3 * C) + (C * C + C) + 2 * C + (4 * C * C + 4 * C) + (
        4 * C * C + C)  # norm1, qkv, out_proj, norm2, fc, proj
    n = V * C + L * per_block + 2 * C  # tied embedding/head, blocks, final norm; no positions
    assert model.num_params(include_position=False) == n
    assert model.num_params() == n + T * C
    assert model.flops_per_token() == 6 * n + 12 * L * T * C
    assert model.flops_per_token(seq_len=8) == 6 * n + 12 * L * 8 * C


# --- config --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, message",
    [
        ({"vocab_size": 0}, "vocab_size=0 must be a positive integer"),
        ({"n_layer": 2.5}, "n_layer=2.5 must be a positive integer"),
        ({"n_head": True}, "n_head=true must be a positive integer"),
        ({"n_embd": 768, "n_head": 5}, "n_embd=768 must be divisible by n_head=5"),
        ({"dropout": 1.0}, r"dropout=1.0 must be a number in \[0, 1\)"),
        ({"bias": "yes"}, "bias='yes' must be true or false"),
        ({"layer_norm_eps": 0}, "layer_norm_eps=0 must be a positive number"),
    ],
)
def test_config_errors_name_field_and_value(values, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**values)


def test_config_reports_several_problems_at_once():
    with pytest.raises(ValueError, match=r"vocab_size=-1 .*; dropout=2 "):
        GPTConfig(vocab_size=-1, dropout=2)


def test_config_from_dict_names_unknown_keys_and_round_trips():
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['n_heads'\]"):
        GPTConfig.from_dict({"n_heads": 4})
    config = GPTConfig(**TINY, dropout=0.1, qkv_bias=False)
    assert GPTConfig.from_dict(config.to_dict()) == config


# --- dependencies ------------------------------------------------------------------------


def test_core_imports_no_framework_and_no_speedups():
    code = (
        "import sys, minigpt.attention, minigpt.model, minigpt.sampling, minigpt.hf, "
        "minigpt.checkpoint, minigpt.checkpoint.consolidate, minigpt.devices, minigpt.inference\n"
        "banned = ('lightning', 'pytorch_lightning', 'hydra', 'omegaconf', 'wandb', "
        "'transformers', 'huggingface_hub', 'minigpt.cpu', 'minigpt.train')\n"
        "print(sorted(m for m in sys.modules if m.startswith(banned)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_block_and_model_import_only_torch_and_the_blocks_helpers():
    """A reader of attention.py and model.py never leaves torch: beyond what ``import torch``
    loads, importing them adds the standard library and the block's variant helpers only."""
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import minigpt.attention, minigpt.model\n"
        "added = set(sys.modules) - before\n"
        "print(sorted(m for m in added if m.split('.')[0] not in sys.stdlib_module_names))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == repr(sorted(
        ["minigpt", "minigpt.attention", "minigpt.documents", "minigpt.field_rules",
         "minigpt.kv_cache", "minigpt.model", "minigpt.rope", "minigpt.sampling",
         "minigpt.window"]))


def test_hf_conversion_does_not_import_the_model_back():
    code = "import sys, minigpt.hf\nprint('minigpt.model' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_core_layers_are_plain_torch():
    model = tiny()
    assert type(model.blocks[0].attn.qkv) is torch.nn.Linear
    assert type(model.blocks[0].attn.out_proj) is torch.nn.Linear
    assert type(model.blocks[0].mlp.fc) is torch.nn.Linear
    assert type(model.lm_head) is torch.nn.Linear


# --- loss ----------------------------------------------------------------------------------------


def test_loss_equals_cross_entropy_of_logits_with_gradients():
    model = tiny()
    idx = torch.randint(0, 97, (2, 16))
    targets = torch.randint(0, 97, (2, 16))
    targets[0, :3] = -100  # ignored
    logits = model(idx).double()  # the oracle: float64 cross-entropy of the plain logits
    reference = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss = model.loss(idx, targets)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), reference, rtol=1e-6, atol=1e-6)
    expected = torch.autograd.grad(reference, list(model.parameters()))
    grads = torch.autograd.grad(loss, list(model.parameters()))
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


def test_loss_under_bfloat16_autocast_matches_autocast_logits():
    model = tiny()
    idx, targets = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = F.cross_entropy(model(idx).flatten(0, 1).float(), targets.flatten())
        loss = model.loss(idx, targets)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, reference, rtol=1e-3, atol=1e-3)
    loss.backward()
    assert model.tok_emb.weight.grad.dtype == torch.float32


def test_loss_rejects_mismatched_targets():
    with pytest.raises(ValueError, match=r"targets must have the shape of idx \(2, 16\)"):
        tiny().loss(torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 15, dtype=torch.long))
