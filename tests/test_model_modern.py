"""The block options of the modern recipe (RMSNorm, QK-norm, ReLU², an untied zero-initialized
head, zero-initialized projections, a logit soft-cap, value embeddings), each alone and all together (also with
rope, a window and grouped-query attention), against a GPT written out from the
formulas (tests/oracles.py): logits, attention weights and the loss; then the invariants every option must keep
(cached == uncached decoding with every decoder, gradients everywhere after a few steps,
checkpoints, the preflight's count) and the Hugging Face export that refuses them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from oracles import ref_attention, ref_hidden, ref_logits

from minigpt.attention import MultiHeadAttention
from minigpt.checkpoint import checkpoint_metadata, load_checkpoint
from minigpt.config import TrainSchema, typed
from minigpt.cpu import speed_up_decoding, speed_up_training
from minigpt.model import GPT, GPTConfig
from minigpt.sampling import generate, pad_prompts
from minigpt.static_decoding import StaticDecoder
from minigpt.tokenizer import get_tokenizer
from minigpt.train.memory import estimate_training_memory
from minigpt.viz import attention_maps

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
ALL = {"norm": "rmsnorm", "qk_norm": True, "mlp": "relu2", "tie_head": False,
       "zero_init_proj": True, "logit_softcap": 3.0, "value_embeddings": True}
OPTIONS = {  # GPTConfig fields on top of the tiny model (2 layers, 2 heads, 32 dims)
    "rmsnorm": {"norm": "rmsnorm"},
    "qk_norm": {"qk_norm": True},
    "relu2": {"mlp": "relu2"},
    "untied": {"tie_head": False},
    "zero_init_proj": {"zero_init_proj": True},
    "softcap": {"logit_softcap": 3.0},
    "value_embeddings": {"value_embeddings": True, "n_layer": 4},  # tables on layers 1 and 3
    "all": ALL,
    "all_no_bias": {**ALL, "bias": False, "qkv_bias": False},
    "all_rope_window_gqa": {**ALL, "position": "rope", "window": 5, "n_head": 4,
                            "num_kv_heads": 2},
}
options = pytest.mark.parametrize("name", list(OPTIONS))


def config(name: str, **overrides) -> GPTConfig:
    fields = {"vocab_size": 61, "context_length": 16, "n_layer": 2, "n_head": 2, "n_embd": 32,
              **OPTIONS[name], **overrides}
    return GPTConfig(**fields)


def tiny(name: str, **overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(config(name, **overrides))


@torch.no_grad()
def scrambled(model: GPT, std: float = 0.5) -> GPT:
    """Every parameter redrawn (zero-initialized ones too, norm gains around 1), so each weight
    changes the function and greedy choices depend strongly on the context."""
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        p.normal_(1.0 if name.endswith("norm1.weight") or name.endswith("norm2.weight")
                  or name == "final_norm.weight" else 0.0, std)
    return model.eval()


# --- config -------------------------------------------------------------------------------------


def test_defaults_are_gpt2_and_old_configs_load():
    config = GPTConfig()
    assert (config.norm, config.qk_norm, config.mlp, config.tie_head, config.zero_init_proj,
            config.logit_softcap, config.value_embeddings) == \
        ("layernorm", False, "gelu", True, False, None, False)
    old = {k: v for k, v in config.to_dict().items() if k not in ALL}
    assert GPTConfig.from_dict(old) == config  # a checkpoint written before the options
    with torch.device("meta"):
        model = GPT(config)
    assert model.lm_head.weight is model.tok_emb.weight
    assert type(model.final_norm) is torch.nn.LayerNorm
    assert len(model.value_embeds) == 0 and not any("value" in k for k in model.state_dict())


@pytest.mark.parametrize("values, message", [
    ({"norm": "batchnorm"}, r"^GPTConfig: norm='batchnorm' must be one of layernorm, rmsnorm$"),
    ({"mlp": "swiglu"}, r"^GPTConfig: mlp='swiglu' must be one of gelu, relu2$"),
    ({"qk_norm": "yes"}, r"^GPTConfig: qk_norm='yes' must be true or false$"),
    ({"tie_head": 0}, r"^GPTConfig: tie_head=0 must be true or false$"),
    ({"zero_init_proj": None}, r"^GPTConfig: zero_init_proj=null must be true or false$"),
    ({"value_embeddings": 1}, r"^GPTConfig: value_embeddings=1 must be true or false$"),
    ({"logit_softcap": 0}, r"^GPTConfig: logit_softcap=0 must be a positive number or null$"),
    ({"logit_softcap": -15.0}, r"^GPTConfig: logit_softcap=-15.0 must be a positive number"),
    ({"logit_softcap": float("inf")}, r"^GPTConfig: logit_softcap=inf must be a positive"),
    ({"logit_softcap": True}, r"^GPTConfig: logit_softcap=true must be a positive number"),
])
def test_bad_values_are_one_line(values, message):
    with pytest.raises(ValueError, match=message) as error:
        GPTConfig(**values)
    assert "\n" not in str(error.value)


def test_several_bad_values_are_reported_together():
    with pytest.raises(ValueError, match=r"norm='x' .*; mlp='y' .*; logit_softcap=-1"):
        GPTConfig(norm="x", mlp="y", logit_softcap=-1)


def test_attention_refuses_a_bad_qk_norm():
    with pytest.raises(ValueError, match=r"^qk_norm=1 must be true or false$"):
        MultiHeadAttention(32, 32, 16, 0.0, 2, qk_norm=1)
    with pytest.raises(ValueError, match=r"^qk_norm_eps=0 must be a positive number$"):
        MultiHeadAttention(32, 32, 16, 0.0, 2, qk_norm=True, qk_norm_eps=0)


def test_hydra_configs_take_the_options():
    """The typed schema knows the fields (Hydra rejects unknown keys), for the toy model and a
    GPT-2 preset, and the config they give builds the model."""
    overrides = ["model.norm=rmsnorm", "model.qk_norm=true", "model.mlp=relu2",
                 "model.tie_head=false", "model.zero_init_proj=true", "model.logit_softcap=15",
                 "model.value_embeddings=true"]
    for preset in ([], ["model=gpt2_small"]):
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
            cfg = compose("train", overrides=preset + overrides)
            default = compose("train", overrides=preset)
        built = typed(cfg, TrainSchema).model.gpt_config(64)
        assert (built.norm, built.qk_norm, built.mlp, built.tie_head, built.zero_init_proj,
                built.logit_softcap, built.value_embeddings) == \
            ("rmsnorm", True, "relu2", False, True, 15.0, True)
        plain = typed(default, TrainSchema).model.gpt_config(64)
        assert plain == GPTConfig(**{**plain.to_dict(), **{k: getattr(GPTConfig(), k)
                                                           for k in ALL}})


# --- each option against the reference -----------------------------------------------------------


@options
def test_logits_and_loss_match_the_reference(name):
    model = scrambled(tiny(name))
    idx = torch.randint(0, 61, (3, 16), generator=torch.Generator().manual_seed(2))
    expected = ref_logits(model, idx)
    torch.testing.assert_close(model(idx), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model(idx, last_only=True), expected[:, -1:], rtol=1e-4,
                               atol=1e-4)
    targets = idx.roll(-1, 1)
    torch.testing.assert_close(model.loss(idx, targets),
                               F.cross_entropy(expected.flatten(0, 1), targets.flatten()),
                               rtol=1e-5, atol=1e-5)
    if model.config.logit_softcap is not None:
        assert expected.abs().max() < model.config.logit_softcap  # the cap is in effect
        assert (model.lm_head(model.hidden_states(idx)).abs().max()
                > model.config.logit_softcap)


@options
def test_attention_weights_and_maps_match_the_reference(name):
    model = scrambled(tiny(name))
    idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(3))
    _, expected = ref_hidden(model, idx)
    maps = attention_maps(model, idx)
    for got, want in zip(maps, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.sum(-1), torch.ones(got.shape[:-1]))


@pytest.mark.parametrize("heads, kv_heads, rope", [(2, 2, False), (4, 2, True), (4, 1, True)])
def test_qk_norm_attention_matches_the_reference(heads, kv_heads, rope):
    """``MultiHeadAttention(qk_norm=True)`` alone (the book's constructor plus keywords): its
    output and ``attention_weights`` against the formulas; QK-norm before rope, as built, equals
    QK-norm after rope (a rotation keeps each head vector's length)."""
    torch.manual_seed(4)
    attn = MultiHeadAttention(32, 32, 16, 0.0, heads, True, num_kv_heads=kv_heads, rope=rope,
                              qk_norm=True, qk_norm_eps=1e-6).eval()
    cfg = GPTConfig(n_head=heads, n_embd=32, num_kv_heads=kv_heads, qk_norm=True,
                    layer_norm_eps=1e-6, position="rope" if rope else "learned")
    x = torch.randn(2, 9, 32)
    sd = attn.state_dict()
    y, w = ref_attention(x, sd, "", cfg)
    torch.testing.assert_close(attn(x), y, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(attn.attention_weights(x), w, rtol=1e-4, atol=1e-6)
    y_after, w_after = ref_attention(x, sd, "", cfg, norm_after_rope=True)
    torch.testing.assert_close(y_after, y, rtol=1e-4, atol=1e-5)
    # normalized: no score can exceed sqrt(hd) in size, whatever the weights' scale
    with torch.no_grad():
        attn.qkv.weight.mul_(100)
    scores = attn.attention_weights(x)
    assert torch.isfinite(scores).all()
    torch.testing.assert_close(scores.sum(-1), torch.ones(scores.shape[:-1]))


def test_qk_norm_changes_the_function():
    """Off by default: the same weights attend differently with and without it."""
    torch.manual_seed(5)
    plain = MultiHeadAttention(32, 32, 16, 0.0, 2).eval()
    normed = MultiHeadAttention(32, 32, 16, 0.0, 2, qk_norm=True).eval()
    normed.load_state_dict(plain.state_dict())
    x = torch.randn(1, 6, 32)
    assert not torch.allclose(plain(x), normed(x))
    assert plain.qk_norm_eps is None and "qk_norm" not in repr(plain)


def test_a_value_embedding_is_added_to_the_values():
    """The same vector for every token shifts every value by it: the attention of a layer whose
    value bias holds that vector (the weights sum to one), scores unchanged; a wrong shape is
    named."""
    torch.manual_seed(6)
    attn = MultiHeadAttention(32, 32, 16, 0.0, 4, True, num_kv_heads=2).eval()
    shifted = MultiHeadAttention(32, 32, 16, 0.0, 4, True, num_kv_heads=2).eval()
    shifted.load_state_dict(attn.state_dict())
    row = torch.randn(16)  # 2 key/value heads of 8
    with torch.no_grad():
        shifted.qkv.bias[-16:] += row
    x = torch.randn(2, 9, 32)
    torch.testing.assert_close(attn(x, value_embedding=row.expand(2, 9, 16)), shifted(x))
    torch.testing.assert_close(attn.attention_weights(x), shifted.attention_weights(x))
    with pytest.raises(ValueError, match=r"^value_embedding must have shape \(batch, tokens, kv "
                                         r"features\)=\(2, 9, 16\), got \(2, 9, 32\)$"):
        attn(x, value_embedding=torch.zeros(2, 9, 32))


# --- decoding: every decoder equals no cache ------------------------------------------------------


def _prompts():
    return pad_prompts([[3, 1, 4, 1, 5, 9, 2], [6], [5, 3, 5]])


@options
def test_cached_decoding_equals_uncached(name):
    model = scrambled(tiny(name))
    idx, mask = _prompts()
    kwargs = dict(temperature=0, key_padding_mask=mask)
    uncached = generate(model, idx, 40, use_cache=False, **kwargs)  # past the context: crops
    assert torch.equal(generate(model, idx, 40, **kwargs), uncached)
    assert torch.equal(generate(model, idx, 40, decoder=StaticDecoder(model, 3), **kwargs),
                       uncached)
    assert len(set(uncached[0, 7:].tolist())) > 3  # not one repeated token: a real test


@options
def test_compiled_static_decoder_equals_uncached(name):
    """The compiled step (inductor on the CPU; a CUDA graph on a GPU) with every option."""
    torch._dynamo.reset()
    model = scrambled(tiny(name))
    idx, mask = _prompts()
    kwargs = dict(temperature=0, key_padding_mask=mask)
    uncached = generate(model, idx, 30, use_cache=False, **kwargs)
    decoder = StaticDecoder(model, 3, compile=True)
    assert torch.equal(generate(model, idx, 30, decoder=decoder, **kwargs), uncached)


@pytest.mark.parametrize("name", ["all", "all_rope_window_gqa"])
def test_packed_cpu_decoding_equals_uncached(name):
    """generate.py's CPU speedup (packed linear weights, the untied head among them)."""
    model = scrambled(tiny(name))
    idx, mask = _prompts()
    kwargs = dict(temperature=0, key_padding_mask=mask)
    uncached = generate(model, idx, 30, use_cache=False, **kwargs)
    speed_up_decoding(model)
    assert torch.equal(generate(model, idx, 30, **kwargs), uncached)


# --- initialization and training ------------------------------------------------------------------


def test_zero_inits_leave_every_other_weight_as_gpt2_draws_it():
    gpt2, zero = tiny("softcap"), tiny("zero_init_proj")  # softcap: same weights as GPT-2
    untied = tiny("untied")
    for name, p in zero.named_parameters():
        if name.endswith(("attn.out_proj.weight", "mlp.proj.weight")):
            assert not p.any(), name
        else:
            assert torch.equal(p, gpt2.state_dict()[name]), name
    assert not untied.lm_head.weight.any()
    assert untied.lm_head.weight is not untied.tok_emb.weight
    idx = torch.randint(0, 61, (2, 8))
    # a zero head: uniform logits, the loss of a uniform guess
    torch.testing.assert_close(untied.loss(idx, idx), torch.tensor(math.log(61)))


@options
def test_a_few_steps_reach_every_parameter(name):
    """Finite losses, and by the third step a gradient on every parameter: a zero matrix gets
    its output's gradient at once and passes one back after it has moved."""
    model = tiny(name, dropout=0.1).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(6)
    for _ in range(3):
        idx = torch.randint(0, 61, (4, 16), generator=g)
        opt.zero_grad()
        loss = model.loss(idx, idx.roll(-1, 1))
        assert torch.isfinite(loss)
        loss.backward()
        opt.step()
    silent = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert silent == []
    if model.config.zero_init_proj:
        assert model.blocks[0].attn.out_proj.weight.any() and model.blocks[1].mlp.proj.weight.any()


def test_cpu_speedups_keep_the_reference_loss_for_soft_capped_logits():
    model = scrambled(tiny("all")).train()
    idx = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(7))
    expected = F.cross_entropy(ref_logits(model, idx).flatten(0, 1), idx.flatten())
    applied = speed_up_training(model, keep_freed_memory=False)
    assert any(line.startswith("chunked LM-head loss") for line in applied)  # soft-capped
    torch.testing.assert_close(model.loss(idx, idx), expected, rtol=1e-5, atol=1e-5)


# --- checkpoints, sizes, export ------------------------------------------------------------------


@options
def test_checkpoint_round_trip(name, tmp_path):
    model = scrambled(tiny(name))
    tokenizer = get_tokenizer("char", text="hear me speak, First Citizen\n")
    meta = checkpoint_metadata(model.config.to_dict(), tokenizer.to_dict())
    torch.save({"state_dict": {"model." + k: v for k, v in model.state_dict().items()},
                "minigpt": meta}, tmp_path / "last.ckpt")
    loaded, _, _ = load_checkpoint(tmp_path / "last.ckpt")
    assert loaded.config == model.config
    assert (loaded.lm_head.weight is loaded.tok_emb.weight) == model.config.tie_head
    idx = torch.randint(0, 61, (2, 16))
    torch.testing.assert_close(loaded(idx), model(idx), rtol=0, atol=0)


@options
def test_parameter_counts_and_the_preflight_agree(name):
    """The config's arithmetic against the built model's tensors (a tied one yielded once)."""
    for cfg in (config(name), config(name, bias=False), config(name, qkv_bias=False)):
        with torch.device("meta"):
            model = GPT(cfg)
        tensors = sum(p.numel() for p in model.parameters())
        assert cfg.num_params() == model.num_params() == tensors, cfg
        positions = model.pos_emb.weight.numel() if model.pos_emb is not None else 0
        assert cfg.num_params(include_position=False) == tensors - positions
        assert estimate_training_memory(cfg.to_dict(), 1).weights == 4 * tensors


def test_sizes_and_flops_of_the_options():
    with torch.device("meta"):
        gpt2, rms, untied = GPT(GPTConfig()), GPT(GPTConfig(norm="rmsnorm")), \
            GPT(GPTConfig(tie_head=False))
    assert gpt2.num_params() - rms.num_params() == (2 * 12 + 1) * 768  # the norms' biases
    assert untied.num_params() - gpt2.num_params() == 50257 * 768
    # the same matmuls: an untied embedding is a lookup
    assert untied.flops_per_token() == gpt2.flops_per_token()
    with torch.device("meta"):  # 4 key/value heads of 64: tables of 256 features
        gqa, valued = GPT(GPTConfig(num_kv_heads=4)), \
            GPT(GPTConfig(num_kv_heads=4, value_embeddings=True))
    assert list(valued.value_embeds) == ["1", "3", "5", "7", "9", "11"]  # the last layer's too
    assert GPTConfig(n_layer=3, value_embeddings=True).value_embedding_layers == (0, 2)
    assert GPTConfig(n_layer=1, value_embeddings=True).value_embedding_layers == (0,)
    assert valued.num_params() - gqa.num_params() == 6 * 50257 * 256
    assert valued.flops_per_token() == gqa.flops_per_token()  # lookups



def test_zero_initialized_projections_export_as_gpt2(tmp_path):
    """zero_init_proj only chooses the starting weights: the trained block is GPT-2's. (The
    options that change the block are refused by name: tests/test_model_variants.py.)"""
    pytest.importorskip("safetensors")
    model = scrambled(tiny("zero_init_proj"))
    model.save_pretrained(str(tmp_path / "hf"))
    again = GPT.from_pretrained(str(tmp_path / "hf"))
    idx = torch.randint(0, 61, (1, 8))
    torch.testing.assert_close(again(idx), model(idx))


def test_a_training_run_with_every_option(tmp_path):
    """train.py's run (the Fabric loop, Muon, the CPU speedups) on the toy data with the options:
    finite losses, a checkpoint that reloads with them."""
    from minigpt.data import prepare_dataset
    from minigpt.train.run import run

    overrides = [
        "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.context_length=32",
        "model.norm=rmsnorm", "model.qk_norm=true", "model.mlp=relu2", "model.tie_head=false",
        "model.zero_init_proj=true", "model.logit_softcap=15", "model.value_embeddings=true",
        "optim=muon",
        "data.batch_size=4", "data.val_tokens=256", "trainer=cpu", "trainer.max_steps=4",
        "trainer.val_check_interval=4", "trainer.enable_progress_bar=false",
        "trainer.precision=32-true", "logger=none", "optim.warmup_steps=1",
        "sample.max_new_tokens=8", f"data_root={tmp_path / 'data'}"]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    prepare_dataset(cfg.data, tmp_path / "data", progress=False)
    summary = run(cfg, run_dir=tmp_path / "run")
    assert summary["steps"] == 4 and math.isfinite(summary["val_loss"])
    model, _, _ = load_checkpoint(summary["last"])
    assert (model.config.norm, model.config.tie_head, model.config.logit_softcap,
            model.config.value_embeddings) == ("rmsnorm", False, 15.0, True)
    assert model.lm_head.weight.any()  # the zero head has moved
