"""Hugging Face GPT-2 interop: ``transformers`` is the independent oracle; no network."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from minigpt.model import GPT, GPTConfig

transformers = pytest.importorskip("transformers")

TINY = dict(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=100)
OURS_TINY = dict(n_layer=2, n_head=2, n_embd=32, context_length=64, vocab_size=100)


def hf_model(seed: int = 0, **overrides):
    """A small random GPT2LMHeadModel, dropout off, non-zero biases and LayerNorm affines so a
    mix-up of any weight shows in the logits."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        **{**TINY, **overrides}, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def hf_logits(model, idx):
    with torch.no_grad():
        return model(idx).logits


def our_logits(model, idx):
    with torch.no_grad():
        return model(idx)


@pytest.fixture
def idx():
    return torch.randint(0, 100, (3, 40), generator=torch.Generator().manual_seed(1))


def test_load_safetensors_matches_transformers(tmp_path, idx):
    ref = hf_model()
    ref.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    model = GPT.from_pretrained(tmp_path)
    assert model.config.n_layer == 2 and model.config.context_length == 64
    assert model.lm_head.weight is model.tok_emb.weight
    assert not model.training
    assert all(p.requires_grad and p.dtype == torch.float32 for p in model.parameters())
    diff = (our_logits(model, idx) - hf_logits(ref, idx)).abs().max().item()
    assert diff <= 1e-4


def test_load_pytorch_bin_old_layout_matches_transformers(tmp_path, idx):
    """``pytorch_model.bin`` as older transformers and the original OpenAI upload wrote it: no
    ``transformer.`` prefix, the causal-mask buffers, an explicit ``lm_head.weight``."""
    ref = hf_model(seed=3)
    ref.config.save_pretrained(tmp_path)
    state = {k.removeprefix("transformer."): v.clone() for k, v in ref.state_dict().items()}
    for i in range(TINY["n_layer"]):
        state[f"h.{i}.attn.bias"] = torch.ones(1, 1, 64, 64).tril().bool()
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(state, tmp_path / "pytorch_model.bin")
    model = GPT.from_pretrained(str(tmp_path))
    diff = (our_logits(model, idx) - hf_logits(ref, idx)).abs().max().item()
    assert diff <= 1e-4


def test_save_loads_into_transformers(tmp_path, idx):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**OURS_TINY)).eval()
    with torch.no_grad():  # non-zero biases and affines, so their layout is checked too
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["architectures"] == ["GPT2LMHeadModel"]
    assert config["activation_function"] == "gelu_new" and config["n_inner"] is None

    ref = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    diff = (hf_logits(ref, idx) - our_logits(model, idx)).abs().max().item()
    assert diff <= 1e-4
    # ... and back into ours, exactly.
    again = GPT.from_pretrained(tmp_path)
    torch.testing.assert_close(our_logits(again, idx), our_logits(model, idx), rtol=0, atol=0)


@pytest.mark.parametrize("bias, qkv_bias", [(False, False), (True, False), (False, True)])
def test_save_without_biases_writes_exact_zeros(tmp_path, idx, bias, qkv_bias):
    """GPT-2 always has biases; a bias-free model saves as zero biases: the same function."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**OURS_TINY, bias=bias, qkv_bias=qkv_bias)).eval()
    model.save_pretrained(tmp_path)
    ref = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    if not qkv_bias:
        assert torch.count_nonzero(ref.transformer.h[0].attn.c_attn.bias) == 0
    diff = (hf_logits(ref, idx) - our_logits(model, idx)).abs().max().item()
    assert diff <= 1e-4
    again = GPT.from_pretrained(tmp_path)
    torch.testing.assert_close(our_logits(again, idx), our_logits(model, idx), rtol=0, atol=0)


def test_save_overwrites_atomically_and_leaves_no_temp_files(tmp_path):
    model = GPT(GPTConfig(**OURS_TINY))
    model.save_pretrained(tmp_path / "out")
    model.save_pretrained(tmp_path / "out")  # over an existing checkpoint
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "model.safetensors"]


def test_config_overrides(tmp_path, idx):
    hf_model().save_pretrained(tmp_path)
    model = GPT.from_pretrained(tmp_path, dropout=0.1, context_length=32)
    assert model.config.dropout == 0.1 and model.pos_emb.weight.shape == (32, 32)
    with pytest.raises(ValueError, match="context_length=128 exceeds .* n_positions=64"):
        GPT.from_pretrained(tmp_path, context_length=128)
    with pytest.raises(ValueError, match="n_layer=4 contradicts the checkpoint"):
        GPT.from_pretrained(tmp_path, n_layer=4)
    with pytest.raises(ValueError, match="unknown field.*'n_heads'"):
        GPT.from_pretrained(tmp_path, n_heads=4)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"activation_function": "relu"}, "activation_function='relu'"),
        ({"scale_attn_weights": False}, "scale_attn_weights=False"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
        ({"n_inner": 100}, "n_inner=100"),
        ({"model_type": "gpt_neo"}, "model_type='gpt_neo'"),
    ],
)
def test_unsupported_config_is_rejected(tmp_path, change, message):
    hf_model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match="unsupported GPT-2 config.*" + message):
        GPT.from_pretrained(tmp_path)


def test_reorder_and_upcast_attn_is_accepted(tmp_path, idx):
    """A numerics-only flag: the function is the same, so it loads."""
    ref = hf_model()
    ref.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "reorder_and_upcast_attn": True}))
    assert (our_logits(GPT.from_pretrained(tmp_path), idx) - hf_logits(ref, idx)).abs().max() < 1e-4


def test_weights_that_do_not_match_config(tmp_path):
    hf_model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_layer": 3}))
    with pytest.raises(ValueError, match=r"missing \['blocks\.2\."):
        GPT.from_pretrained(tmp_path)


def test_offline_hub_name_fails_with_one_clear_line(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))  # empty
    monkeypatch.chdir(tmp_path)  # so "openai-community/gpt2" is not a local path by chance
    for name in ("gpt2", "gpt2-xl", "openai-community/gpt2"):
        with pytest.raises(OSError) as info:
            GPT.from_pretrained(name)
        message = str(info.value)
        assert "\n" not in message
        assert repr(name) in message and "offline" in message and "local directory" in message
        assert info.value.__cause__ is None and info.value.__suppress_context__


def test_missing_path_fails_with_one_clear_line(tmp_path):
    for path in (tmp_path / "nope", "./no/such/dir"):
        with pytest.raises(FileNotFoundError, match="no such checkpoint directory") as info:
            GPT.from_pretrained(path)
        assert "\n" not in str(info.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        GPT.from_pretrained(tmp_path / "empty")
    hf_model().config.save_pretrained(tmp_path / "no-weights")
    with pytest.raises(FileNotFoundError, match="no model.safetensors or pytorch_model.bin"):
        GPT.from_pretrained(tmp_path / "no-weights")


def tiny_dir(tmp_path):
    """A Hugging Face GPT-2 directory written by us (no transformers needed)."""
    torch.manual_seed(0)
    GPT(GPTConfig(**OURS_TINY)).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_a_pytorch_model_bin_carrying_code_is_refused_and_never_runs(tmp_path):
    from payload import save_with_payload

    directory = tiny_dir(tmp_path)
    (directory / "model.safetensors").unlink()
    marker = tmp_path / "payload-ran"
    save_with_payload(directory / "pytorch_model.bin", marker)
    with pytest.raises(ValueError) as error:
        GPT.from_pretrained(directory)
    message = str(error.value)
    assert f"{directory / 'pytorch_model.bin'} holds Python objects" in message
    assert "code" in message and "weights_only=False" not in message and "\n" not in message
    assert not marker.exists()


def test_a_cut_short_or_misshapen_safetensors_is_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    directory = tiny_dir(tmp_path)
    weights = directory / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=f"{weights} is not a readable safetensors file .*"
                                         "truncated") as error:
        GPT.from_pretrained(directory)
    assert "\n" not in str(error.value)
    weights.write_bytes(whole)
    tensors = load_file(weights)
    tensors["transformer.h.1.mlp.c_fc.weight"] = torch.zeros(32, 100)  # GPT-2's is (32, 128)
    save_file(tensors, weights)
    with pytest.raises(ValueError, match=r"blocks\.1\.mlp\.fc\.weight has shape \(100, 32\), but "
                                         r"config.json .* implies \(128, 32\)"):
        GPT.from_pretrained(directory)


@pytest.mark.parametrize("text, message", [
    ('{"n_layer": 2,', "is not readable JSON"),
    ("[1, 2]", "holds a JSON list, not an object"),
    (json.dumps({**TINY, "n_head": "two"}), "n_head='two' (must be an integer >= 1)"),
    (json.dumps({**TINY, "n_head": 3}), "n_embd=32 (must be a multiple of n_head=3)"),
])
def test_a_broken_config_json_is_one_line(tmp_path, text, message):
    directory = tiny_dir(tmp_path)
    (directory / "config.json").write_text(text)
    with pytest.raises(ValueError) as error:
        GPT.from_pretrained(directory)
    assert str(directory / "config.json") in str(error.value) and message in str(error.value)
    assert "\n" not in str(error.value)


# --- the export table: every GPTConfig field classified --------------------------------------


def test_every_gpt_config_field_is_classified_for_export():
    from minigpt.hf import GPT2_FIELDS

    names = [f.name for f in dataclasses.fields(GPTConfig)]
    assert sorted(set(names) - set(GPT2_FIELDS)) == [], "classify these in minigpt.hf.GPT2_FIELDS"
    assert sorted(set(GPT2_FIELDS) - set(names)) == []


def test_export_refuses_a_field_the_table_does_not_classify(tmp_path):
    """A block option added as docs/extending.md says, before minigpt.hf knows it: refused even
    at its off value, since export cannot tell whether GPT-2 computes it."""
    Extended = dataclasses.make_dataclass(
        "Extended", [("parallel_residual", bool, False)], bases=(GPTConfig,))
    for value in (True, False):
        model = GPT(Extended(**OURS_TINY, parallel_residual=value))
        with pytest.raises(ValueError, match=f"cannot export parallel_residual={value} to Hugging "
                                             "Face GPT-2: the field is not in minigpt.hf"):
            model.save_pretrained(tmp_path / "hf")
        assert not (tmp_path / "hf").exists()


def test_a_fixed_field_is_refused_in_the_words_of_its_own_value(tmp_path):
    model = GPT(GPTConfig(**OURS_TINY))
    model.config.mlp = "silu"  # as if an extension had added the activation
    with pytest.raises(ValueError) as error:
        model.save_pretrained(tmp_path / "hf")
    assert str(error.value) == ("cannot export mlp='silu' to Hugging Face GPT-2, whose block has "
                                "only mlp='gelu'; keep the .ckpt for this model")


def test_training_only_fields_export_as_gpt2(tmp_path, idx):
    """A window schedule ends at the full context and a document mask only shapes packed
    training rows: the model exports, and transformers computes its logits."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**OURS_TINY, window_schedule=[32, 64], document_mask=True,
                          dropout=0.1)).eval()
    model.save_pretrained(tmp_path)
    ref = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert ref.config.resid_pdrop == 0.1
    assert (hf_logits(ref, idx) - our_logits(model, idx)).abs().max().item() <= 1e-4
