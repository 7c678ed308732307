"""GPT with each attention variant: config checks, sizes, caches, sampling, checkpoints,
generate.py, and the Hugging Face export that only GPT-2's block can take."""

from __future__ import annotations

import importlib.util
import io
import math
import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from minigpt.checkpoint import checkpoint_metadata, load_checkpoint
from minigpt.model import GPT, GPTConfig
from minigpt.sampling import generate, pad_prompts
from minigpt.tokenizer import get_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("generate_cli", ROOT / "generate.py")
generate_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate_cli)

VARIANTS = {  # GPTConfig fields at 2 heads
    "gpt2": {},
    "mqa": {"num_kv_heads": 1},
    "rope": {"position": "rope"},
    "window": {"window": 5},
    "rope_window": {"position": "rope", "window": 5},
}
variants = pytest.mark.parametrize("name", list(VARIANTS))


def tiny(name: str, context_length: int = 16, vocab_size: int = 61, init_std: float = 1.0) -> GPT:
    torch.manual_seed(0)
    # init_std=1: greedy choices depend strongly on the context, so a wrong cache, position or
    # window shows up as different tokens
    return GPT(GPTConfig(vocab_size=vocab_size, context_length=context_length, n_layer=2,
                         n_head=2, n_embd=32, init_std=init_std, **VARIANTS[name])).eval()


# --- config ---------------------------------------------------------------------------------------


def test_defaults_are_gpt2_and_old_configs_load():
    config = GPTConfig()
    assert (config.num_kv_heads, config.position, config.window) == (None, "learned", None)
    old = {k: v for k, v in config.to_dict().items()
           if k not in ("num_kv_heads", "position", "rope_theta", "window")}
    assert GPTConfig.from_dict(old) == config  # a checkpoint written before the variants


@pytest.mark.parametrize("values, message", [
    ({"num_kv_heads": 5}, r"^GPTConfig: num_kv_heads=5 must divide num_heads=12$"),
    ({"num_kv_heads": 0}, r"^GPTConfig: num_kv_heads=0 must be an integer in \[1, num_heads=12\]$"),
    ({"window": 0}, r"^GPTConfig: window=0 must be a positive integer"),
    ({"n_embd": 36, "n_head": 12, "position": "rope"},
     r"^GPTConfig: rope needs an even head dimension, got head_dim=3$"),
    ({"position": "alibi"}, r"^GPTConfig: position='alibi' must be one of learned, rope$"),
])
def test_config_errors_are_one_line(values, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**values)


# --- sizes ----------------------------------------------------------------------------------------


def test_sizes_of_the_variants():
    with torch.device("meta"):
        mha = GPT(GPTConfig())
        mqa = GPT(GPTConfig(num_kv_heads=1))
        rope = GPT(GPTConfig(position="rope"))
    assert mha.kv_cache_bytes_per_token() == 2 * 12 * 768 * 4
    assert mha.kv_cache_bytes_per_token() == 12 * mqa.kv_cache_bytes_per_token()  # the target
    assert mqa.blocks[0].attn.qkv.weight.shape == (768 + 2 * 64, 768)
    assert mha.num_params() - mqa.num_params() == 12 * 2 * (768 - 64) * (768 + 1)
    assert rope.pos_emb is None
    assert rope.num_params() == mha.num_params() - 1024 * 768
    assert rope.num_params(include_position=False) == rope.num_params()


def test_window_model_caches_are_rings_of_window_slots():
    model = tiny("rope_window")
    cache = model.new_kv_cache(3)
    assert cache.ring and cache.capacity == 5
    assert len(cache.keys) == 2 and cache.keys[0].shape == (3, 2, 5, 16)  # one buffer per layer
    bounded = tiny("window").new_kv_cache(1, 4)
    assert bounded.capacity == 4 and not bounded.ring  # bounded by the context


# --- the model's invariants, for every variant --------------------------------------------------


@variants
def test_kv_cache_in_chunks_equals_one_full_pass(name):
    model = tiny(name, init_std=0.02)
    idx = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(1))
    cache = model.new_kv_cache(2)
    parts, start = [], 0
    for n in (6, 1, 1, 5, 3):
        parts.append(model(idx[:, start : start + n], kv_cache=cache))
        start += n
    torch.testing.assert_close(torch.cat(parts, 1), model(idx), rtol=1e-5, atol=1e-5)


@variants
def test_cache_rows_continue_each_picked_row(name):
    """``KVCache.rows``: a context's cache continued several ways (multiple-choice scoring) gives
    the logits of each full sequence, and leaves the original cache as it was."""
    model = tiny(name, init_std=0.02)
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 61, (2, 9), generator=gen)
    rest = torch.randint(0, 61, (3, 3), generator=gen)
    pick = torch.tensor([1, 1, 0])
    with torch.inference_mode():
        cache = model.new_kv_cache(2)
        model(idx[:, :6], kv_cache=cache)
        got = model(rest, kv_cache=cache.rows(pick))
        full = model(torch.cat([idx[pick, :6], rest], 1))[:, 6:]
        torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(idx[:, 6:], kv_cache=cache), model(idx)[:, 6:],
                                   rtol=1e-5, atol=1e-5)


@variants
def test_cached_greedy_equals_uncached_across_crops(name):
    model = tiny(name)
    idx = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(2))
    cached = generate(model, idx, 40, temperature=0)  # past context_length=16
    assert torch.equal(cached, generate(model, idx, 40, temperature=0, use_cache=False))
    assert len(set(cached[0, 5:].tolist())) > 5


@variants
def test_left_padded_batch_equals_each_row_alone(name):
    model = tiny(name)
    prompts = [[5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 43]]
    alone = [generate(model, torch.tensor([p]), 25, temperature=0)[0].tolist() for p in prompts]
    idx, mask = pad_prompts(prompts)
    for use_cache in (True, False):
        out = generate(model, idx, 25, temperature=0, key_padding_mask=mask, use_cache=use_cache)
        for row, p in enumerate(prompts):
            assert out[row, 11 - len(p):].tolist() == alone[row], f"row {row}, cache={use_cache}"


def test_rope_window_generates_past_the_context_without_refills():
    """4 x context_length new tokens: one pass over the prompt, then one token per step (no
    crop-and-refill), through caches that never grow; the same tokens as the model run on the
    whole sequence every step."""
    model = tiny("rope_window")
    fed = []
    model.register_forward_pre_hook(lambda m, args, kwargs: fed.append(args[0].shape[1]),
                                    with_kwargs=True)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    out = generate(model, prompt, 64, temperature=0)
    assert fed == [5] + [1] * 63
    seq = prompt[0].tolist()
    for _ in range(64):  # the oracle: the whole sequence, every step, no cache
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert out[0].tolist() == seq


def test_learned_window_still_crops_at_the_context():
    model = tiny("window")
    fed = []
    model.register_forward_pre_hook(lambda m, args, kwargs: fed.append(args[0].shape[1]),
                                    with_kwargs=True)
    generate(model, torch.tensor([[1, 2, 3]]), 20, temperature=0)
    assert max(fed) > 1 and fed.count(8) == 1  # one refill of context_length // 2 tokens


# --- checkpoints and generate.py ----------------------------------------------------------------


def run_generate_py(*overrides: str) -> list[str]:
    """generate.py's run on a config composed as the command line would."""
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("generate", overrides=list(overrides))
    return generate_cli.run(cfg, out=io.StringIO())


def save_checkpoint(path, model, tokenizer):
    meta = checkpoint_metadata(model.config.to_dict(), tokenizer.to_dict())
    torch.save({"state_dict": {"model." + k: v for k, v in model.state_dict().items()},
                "minigpt": meta}, path)
    return path


@variants
def test_checkpoint_round_trip_and_generate_py(name, tmp_path):
    tokenizer = get_tokenizer("char", text="hear me speak, First Citizen\n")
    model = tiny(name, context_length=16, vocab_size=64, init_std=0.5)
    path = save_checkpoint(tmp_path / "last.ckpt", model, tokenizer)
    loaded, _, meta = load_checkpoint(path)
    assert loaded.config == model.config and meta["model_config"]["window"] == model.config.window
    idx = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(loaded(idx), model(idx), rtol=0, atol=0)
    ids = generate(model, torch.tensor([tokenizer.encode("hear")]), 30, temperature=0,
                   vocab_size=tokenizer.vocab_size)[0].tolist()
    samples = run_generate_py(f"ckpt_path={path}", "prompt=hear", "temperature=0",
                                 "max_new_tokens=30", "stop_at_eot=false", "cpu_speedups=false")
    assert samples == [tokenizer.decode(ids)]


# --- Hugging Face GPT-2 export --------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("num_kv_heads", 1), ("position", "rope"), ("window", 4), ("norm", "rmsnorm"),
    ("qk_norm", True), ("mlp", "relu2"), ("tie_head", False), ("logit_softcap", 15.0),
    ("value_embeddings", True)])
def test_exporting_a_variant_to_gpt2_names_the_field(tmp_path, field, value):
    model = GPT(GPTConfig(vocab_size=61, context_length=16, n_layer=1, n_head=2, n_embd=32,
                          **{field: value}))
    with pytest.raises(ValueError, match=re.escape(
            f"cannot export {field}={value!r} to Hugging Face GPT-2, whose block has only "
            f"{field}=")) as error:
        model.save_pretrained(str(tmp_path / "hf"))
    assert "\n" not in str(error.value)
    assert not (tmp_path / "hf").exists()


def test_two_kv_heads_at_two_heads_is_gpt2_and_exports(tmp_path):
    pytest.importorskip("safetensors")
    model = GPT(GPTConfig(vocab_size=61, context_length=16, n_layer=1, n_head=2, n_embd=32,
                          num_kv_heads=2))
    model.save_pretrained(str(tmp_path / "hf"))
    again = GPT.from_pretrained(str(tmp_path / "hf"))
    idx = torch.randint(0, 61, (1, 8))
    torch.testing.assert_close(again(idx), model.eval()(idx))


def test_flops_count_the_window():
    full, windowed = tiny("gpt2"), tiny("window")
    assert full.flops_per_token() - windowed.flops_per_token() == 12 * 2 * (16 - 5) * 32
    assert math.isclose(windowed.flops_per_token(seq_len=4), full.flops_per_token(seq_len=4))


def test_generate_py_runs_a_rope_window_checkpoint_past_its_context(tmp_path):
    tokenizer = get_tokenizer("char", text="hear me speak")
    path = save_checkpoint(tmp_path / "x.ckpt", tiny("rope_window", vocab_size=64, init_std=0.5),
                           tokenizer)
    samples = run_generate_py(f"ckpt_path={path}", "prompt=hear", "max_new_tokens=50",
                              "temperature=0", "stop_at_eot=false")
    assert len(samples[0]) == len("hear") + 50  # 54 characters from a 16-token context


def test_generate_py_keeps_a_long_prompt_whole_for_a_rope_window_model(tmp_path, capsys):
    tokenizer = get_tokenizer("char", text="hear me speak")
    model = tiny("rope_window", vocab_size=64, init_std=0.5)
    path = save_checkpoint(tmp_path / "x.ckpt", model, tokenizer)
    prompt = "hear me speak " * 3  # 42 tokens, the context is 16
    ids = generate(model, torch.tensor([tokenizer.encode(prompt)]), 20, temperature=0,
                   vocab_size=tokenizer.vocab_size)[0].tolist()
    samples = run_generate_py(f"ckpt_path={path}", f"prompt='{prompt}'", "max_new_tokens=20",
                              "temperature=0", "stop_at_eot=false")
    assert samples == [tokenizer.decode(ids)]  # the sampler saw all 42 tokens
    assert "conditioning on the last" not in capsys.readouterr().err


def test_attention_maps_show_the_window_band():
    from minigpt.viz import attention_maps

    model = tiny("rope_window")
    ids = torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(3))
    pad = torch.zeros(1, 3, dtype=torch.long)
    mask = torch.tensor([[True] * 3 + [False] * 12])
    positions = (torch.arange(15) - 3).clamp(min=0)[None]
    alone = attention_maps(model, ids)
    padded = attention_maps(model, torch.cat([pad, ids], 1), mask, positions)
    for a, p in zip(alone, padded, strict=True):
        assert (a.tril(-5) == 0).all() and (a.triu(1) == 0).all()  # causal, 5 keys at most
        torch.testing.assert_close(p[..., 3:, 3:], a, rtol=1e-5, atol=1e-6)
