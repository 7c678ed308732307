"""Sampling steps (pure functions, checked with numbers) and the generation loop (KV cache ==
no cache, left-padded batches == prompts alone, context crops == an independent window oracle)."""

import math

import pytest
import torch

from minigpt.model import GPT, GPTConfig
from minigpt.sampling import (
    apply_temperature,
    generate,
    pad_prompts,
    sample_next,
    top_k_filter,
    top_p_filter,
)

NEG_INF = float("-inf")


pytestmark = pytest.mark.usefixtures("one_thread")


# ---- pure functions ------------------------------------------------------------------------

def test_top_k_1_equals_argmax():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        assert torch.equal(sample_next(logits, 1.0, top_k=1, generator=g), logits.argmax(-1))


def test_top_k_filter_keeps_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    expected = torch.tensor([[NEG_INF, 5.0, 3.0, 4.0, NEG_INF]])
    assert torch.equal(top_k_filter(logits, 3), expected)
    assert torch.equal(top_k_filter(logits, 10), logits)


def test_top_p_keeps_smallest_set_reaching_p():
    # probabilities 0.5, 0.25, 0.15, 0.1 (sum 1): exact in binary where it matters
    probs = torch.tensor([[0.1, 0.5, 0.15, 0.25]])
    logits = probs.log()

    def kept(p):
        return torch.isfinite(top_p_filter(logits, p))[0].tolist()

    assert kept(0.4) == [False, True, False, False]  # 0.5 alone reaches 0.4
    assert kept(0.5) == [False, True, False, False]  # exactly reached: no more needed
    assert kept(0.7) == [False, True, False, True]  # 0.5 + 0.25 = 0.75 >= 0.7
    assert kept(0.75) == [False, True, False, True]
    assert kept(0.8) == [False, True, True, True]  # 0.9 >= 0.8
    assert kept(0.95) == [True, True, True, True]
    assert kept(1.0) == [True, True, True, True]
    # kept logits are unchanged
    assert torch.equal(top_p_filter(logits, 0.7)[0, [1, 3]], logits[0, [1, 3]])


def test_top_p_samples_only_from_the_nucleus():
    probs = torch.tensor([[0.1, 0.5, 0.15, 0.25]]).expand(2000, 4)
    g = torch.Generator().manual_seed(0)
    tokens = sample_next(probs.log(), 1.0, top_p=0.7, generator=g)
    assert set(tokens.tolist()) == {1, 3}
    frac_1 = (tokens == 1).float().mean().item()  # renormalized: 0.5 / 0.75
    assert abs(frac_1 - 2 / 3) < 0.05


def test_temperature_scales_logits_and_zero_is_greedy():
    logits = torch.tensor([[1.0, 2.0, 4.0]])
    torch.testing.assert_close(apply_temperature(logits, 2.0), torch.tensor([[0.5, 1.0, 2.0]]))
    many = torch.randn(16, 30, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample_next(many, 0.0, top_k=5, top_p=0.5, generator=g), many.argmax(-1))
    # a low temperature sharpens: sampled tokens concentrate on the argmax
    g = torch.Generator().manual_seed(0)
    cold = sample_next(logits.expand(500, 3), 0.1, generator=g)
    assert (cold == 2).float().mean() > 0.99


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    a = [sample_next(logits, 0.8, 20, 0.9, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(a[0], a[1])
    many = {tuple(sample_next(logits, 1.0, generator=torch.Generator().manual_seed(s)).tolist())
            for s in range(10)}
    assert len(many) > 1  # the seed matters


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -0.5}, r"temperature=-0.5 must be >= 0"),
        ({"temperature": math.nan}, r"temperature=nan must be >= 0"),
        ({"top_p": 0.0}, r"top_p=0.0 must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p=1.5 must be in \(0, 1\]"),
        ({"top_k": 0}, r"top_k=0 must be an integer >= 1"),
        ({"top_k": 2.5}, r"top_k=2.5 must be an integer >= 1"),
    ],
)
def test_invalid_sampling_values_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sample_next(torch.zeros(1, 5), **kwargs)


def test_several_invalid_values_reported_together():
    with pytest.raises(ValueError, match=r"temperature.*top_k.*top_p"):
        sample_next(torch.zeros(1, 5), -1.0, top_k=0, top_p=2.0)


def test_filters_reject_invalid_values():
    with pytest.raises(ValueError, match="top_p"):
        top_p_filter(torch.zeros(1, 3), 1.01)
    with pytest.raises(ValueError, match="top_k"):
        top_k_filter(torch.zeros(1, 3), 0)
    with pytest.raises(ValueError, match="temperature"):
        apply_temperature(torch.zeros(1, 3), 0.0)


# ---- the generation loop -------------------------------------------------------------------

def tiny_model(context_length=16, vocab_size=61, seed=0):
    torch.manual_seed(seed)
    # init_std=1: a random model whose greedy choices depend strongly on the context, so a wrong
    # cache, position or window shows up as different tokens (at 0.02 it repeats one token).
    config = GPTConfig(vocab_size=vocab_size, context_length=context_length, n_layer=2, n_head=2,
                       n_embd=32, init_std=1.0)
    return GPT(config).eval()


def window_oracle(model, prompt, n, keep):
    """Greedy decoding written plainly: the model on the window seq[start:] every step; when a
    new token would overflow the context the window restarts at the last ``keep`` tokens."""
    ctx = model.config.context_length
    seq, start = list(prompt), max(0, len(prompt) - ctx)
    for _ in range(n):
        logits = model(torch.tensor([seq[start:]]))[0, -1]
        seq.append(int(logits.argmax()))
        if len(seq) - start > ctx:
            start = len(seq) - keep
    return seq


def test_greedy_with_cache_equals_without_cache():
    model = tiny_model(context_length=64)
    idx = torch.randint(0, 61, (3, 7), generator=torch.Generator().manual_seed(0))
    cached = generate(model, idx, 40, temperature=0)
    uncached = generate(model, idx, 40, temperature=0, use_cache=False)
    assert cached.shape == (3, 47)
    assert torch.equal(cached[:, :7], idx)
    assert torch.equal(cached, uncached)
    assert len(set(cached[0, 7:].tolist())) > 5  # a meaningful comparison, not one token repeated


def test_bfloat16_autocast_decodes_into_the_float32_cache():
    """The training-time sampler runs under bf16 autocast (``bf16-mixed``): keys and values come
    out in bfloat16 and are stored in the float32 model's cache; the tokens are no cache's."""
    model = tiny_model(context_length=16)
    idx, mask = pad_prompts([[3, 1, 4, 1, 5, 9, 2], [6], [5, 3, 5]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cached = generate(model, idx, 30, temperature=0, key_padding_mask=mask)
        uncached = generate(model, idx, 30, temperature=0, key_padding_mask=mask, use_cache=False)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("crop_to", [None, 1, 5, 15, 16])
def test_cache_matches_window_oracle_across_crops(crop_to):
    model = tiny_model(context_length=16)
    prompt = [3, 1, 4, 1, 5, 9]
    keep = crop_to or 8
    expected = window_oracle(model, prompt, 45, keep)  # several crops past context_length=16
    idx = torch.tensor([prompt])
    for use_cache in (True, False):
        out = generate(model, idx, 45, temperature=0, crop_to=crop_to, use_cache=use_cache)
        assert out[0].tolist() == expected, f"use_cache={use_cache}"


def test_crop_to_context_length_is_the_sliding_window():
    model = tiny_model(context_length=16)
    seq = [7, 2, 9]
    for _ in range(40):  # the nanoGPT loop: always the last context_length tokens
        seq.append(int(model(torch.tensor([seq[-16:]]))[0, -1].argmax()))
    out = generate(model, torch.tensor([[7, 2, 9]]), 40, temperature=0, crop_to=16)
    assert out[0].tolist() == seq


def test_prompt_longer_than_context_is_cropped_with_a_warning():
    model = tiny_model(context_length=16)
    prompt = torch.randint(0, 61, (1, 30), generator=torch.Generator().manual_seed(3)).tolist()[0]
    with pytest.warns(UserWarning, match="longer than context_length=16"):
        out = generate(model, torch.tensor([prompt]), 20, temperature=0)
    assert out[0].tolist() == window_oracle(model, prompt, 20, 8)


def test_left_padded_batch_gives_each_prompt_its_own_tokens():
    model = tiny_model(context_length=16)
    prompts = [[5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 43]]
    alone = [generate(model, torch.tensor([p]), 30, temperature=0)[0].tolist() for p in prompts]
    idx, mask = pad_prompts(prompts, pad_id=0)
    assert mask.tolist()[0] == [True] * 10 + [False]
    for use_cache in (True, False):
        out = generate(model, idx, 30, temperature=0, key_padding_mask=mask, use_cache=use_cache)
        for row, p in enumerate(prompts):
            # 30 new tokens from prompts of 1..11 tokens: rows cross context_length=16 (and crop)
            # at different steps
            assert out[row, 11 - len(p):].tolist() == alone[row], f"row {row}, cache={use_cache}"


def test_seeded_generation_is_reproducible_and_cache_independent():
    model = tiny_model()
    idx = torch.tensor([[1, 2, 3]])

    def run(seed, use_cache=True):
        g = torch.Generator().manual_seed(seed)
        return generate(model, idx, 25, temperature=0.9, top_k=20, top_p=0.95, generator=g,
                        use_cache=use_cache)

    assert torch.equal(run(0), run(0))
    assert torch.equal(run(0), run(0, use_cache=False))
    assert not torch.equal(run(0), run(1))


def test_eos_stops_and_fills_finished_rows():
    model = tiny_model(context_length=64)
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    free = generate(model, idx, 20, temperature=0)
    eos = int(free[0, 6])  # row 0 produces it by its 4th new token

    def new_until_eos(row):  # new tokens up to and including the first eos
        hits = (free[row, 3:] == eos).nonzero()
        return int(hits[0]) + 1 if len(hits) else 20

    alone = generate(model, idx[:1], 20, temperature=0, eos_id=eos)
    assert alone[0].tolist() == free[0, :3 + new_until_eos(0)].tolist()  # stopped early
    out = generate(model, idx, 20, temperature=0, eos_id=eos)
    assert out.shape[1] == 3 + max(new_until_eos(0), new_until_eos(1))
    for row in (0, 1):
        n = 3 + new_until_eos(row)
        assert out[row, :n].tolist() == free[row, :n].tolist()
        assert (out[row, n:] == eos).all()


def test_streaming_callback_sees_every_token():
    model = tiny_model()
    seen = []
    out = generate(model, torch.tensor([[1, 2]]), 12, temperature=0,
                   on_token=lambda t: seen.append(t.clone()))
    assert torch.equal(torch.stack(seen, 1), out[:, 2:])


def test_padded_vocabulary_is_never_sampled():
    model = tiny_model(vocab_size=64)
    with torch.no_grad():
        model.lm_head.weight[50:] *= 100  # make the padding ids overwhelmingly likely
    idx = torch.tensor([[1, 2, 3]])
    assert (generate(model, idx, 30, temperature=0)[:, 3:] >= 50).any()
    for temperature in (0.0, 1.0):
        out = generate(model, idx, 30, temperature=temperature, vocab_size=50,
                       generator=torch.Generator().manual_seed(0))
        assert (out < 50).all()


def test_model_generate_delegates_and_restores_training_mode():
    model = tiny_model().train()
    idx = torch.tensor([[1, 2, 3]])
    out = model.generate(idx, 10, temperature=0)
    assert model.training
    assert torch.equal(out, generate(model.eval(), idx, 10, temperature=0))


def test_bfloat16_weights_decode():
    model = tiny_model(context_length=32).to(torch.bfloat16)
    idx = torch.tensor([[1, 2, 3]])
    cached = generate(model, idx, 20, temperature=0)
    assert torch.equal(cached, generate(model, idx, 20, temperature=0, use_cache=False))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"idx": torch.zeros(1, 0, dtype=torch.long)}, r"at least one prompt token"),
        ({"idx": torch.tensor([[1, 99]])}, r"token ids must be in \[0, 61\), got ids in \[1, 99\]"),
        ({"idx": torch.tensor([1, 2])}, r"idx must be a \(batch, tokens\) long tensor"),
        ({"max_new_tokens": -1}, r"max_new_tokens=-1 must be an integer >= 0"),
        ({"crop_to": 0}, r"crop_to=0 must be in \[1, context_length=16\]"),
        ({"top_p": 1.2}, r"top_p=1.2 must be in \(0, 1\]"),
        ({"temperature": -1}, r"temperature=-1 must be >= 0"),
        ({"key_padding_mask": torch.tensor([[False, True]])}, r"left padding only"),
        ({"key_padding_mask": torch.tensor([[True, True]])}, r"row 0 is all padding"),
    ],
)
def test_generate_rejects_bad_input(kwargs, match):
    args = {"idx": torch.tensor([[1, 2]]), "max_new_tokens": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(tiny_model(), **args)


def test_cache_runs_the_prompt_once_then_one_token_per_step():
    model = tiny_model(context_length=16)
    fed = []
    model.register_forward_pre_hook(lambda m, args, kwargs: fed.append(args[0].shape[1]),
                                    with_kwargs=True)
    generate(model, torch.tensor([[1, 2, 3, 4, 5]]), 12, temperature=0)  # 17 tokens, no crop
    assert fed == [5] + [1] * 11  # the last sampled token needs no forward pass
    fed.clear()
    generate(model, torch.tensor([[1, 2, 3, 4, 5]]), 20, temperature=0, crop_to=6)
    # tokens 6..16 fill the context one at a time; the 17th overflows it: one refill pass over
    # the last 6 tokens, then one token at a time again
    assert fed == [5] + [1] * 11 + [6] + [1] * 7


def test_zero_new_tokens_returns_the_prompt():
    idx = torch.tensor([[1, 2, 3]])
    assert torch.equal(generate(tiny_model(), idx, 0), idx)
