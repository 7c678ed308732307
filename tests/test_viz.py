"""Attention maps and run plots: the weights by invariants and a hand computation, PNGs by size,
run plots on a real short training run."""

import subprocess
import sys

import pytest
import torch

from minigpt.model import GPT, GPTConfig
from minigpt.viz.attention_maps import (
    attention_maps,
    figure_layout,
    plot_attention,
    select_panels,
    token_labels,
)

TINY = dict(vocab_size=50, context_length=16, n_layer=2, n_head=2, n_embd=32)


def tiny_gpt(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **overrides}))


class CharTokenizer:
    """Stand-in with the Tokenizer interface's decode: id i <-> chr(32 + i)."""

    def decode(self, ids):
        return "".join(chr(32 + i) for i in ids)


# --- attention_maps ------------------------------------------------------------------------


def test_maps_are_causal_rows_sum_to_one_one_per_layer():
    model = tiny_gpt()
    idx = torch.randint(0, 50, (3, 12))
    maps = attention_maps(model, idx)
    assert len(maps) == TINY["n_layer"]
    upper = torch.ones(12, 12, dtype=torch.bool).triu(1)
    for w in maps:
        assert w.shape == (3, TINY["n_head"], 12, 12)
        assert torch.all(w[..., upper] == 0)
        assert torch.all(w[..., ~upper] > 0)  # the check above is not vacuous: softmax > 0
        torch.testing.assert_close(w.sum(-1), torch.ones(3, TINY["n_head"], 12))


def test_maps_match_a_hand_computation_layer_by_layer():
    """Independent oracle: q, k from the fused weight's row blocks, softmax by hand, and the
    residual stream advanced with the model's own blocks."""
    model = tiny_gpt(seed=1).eval()
    T, nh, C = 10, TINY["n_head"], TINY["n_embd"]
    hd = C // nh
    idx = torch.randint(0, 50, (2, T))
    maps = attention_maps(model, idx)
    with torch.no_grad():
        x = model.tok_emb(idx) + model.pos_emb(torch.arange(T))
        for block, got in zip(model.blocks, maps, strict=True):
            h = block.norm1(x)
            wq, wk, _ = block.attn.qkv.weight.split(C, dim=0)
            bq, bk, _ = block.attn.qkv.bias.split(C, dim=0)
            q = (h @ wq.T + bq).view(2, T, nh, hd).transpose(1, 2)
            k = (h @ wk.T + bk).view(2, T, nh, hd).transpose(1, 2)
            scores = q @ k.transpose(-1, -2) / hd**0.5
            scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), -torch.inf)
            torch.testing.assert_close(got, scores.softmax(-1))
            x = block(x)


def test_weights_times_values_give_the_fused_layer_output():
    """The maps are the weights the fast SDPA path really uses: weights @ v -> out_proj equals
    the attention layer's forward output."""
    model = tiny_gpt(seed=2).eval()
    idx = torch.randint(0, 50, (1, 9))
    attn = model.blocks[1].attn
    seen = {}
    handle = attn.register_forward_hook(lambda m, args, out: seen.update(x=args[0], y=out))
    with torch.no_grad():
        model(idx)
    handle.remove()
    w = attention_maps(model, idx)[1]  # (1, nh, T, T)
    B, T, C = seen["x"].shape
    v = attn.qkv(seen["x"])[..., 2 * C :].view(B, T, attn.num_heads, -1).transpose(1, 2)
    with torch.no_grad():
        y = attn.out_proj((w @ v).transpose(1, 2).reshape(B, T, C))
    torch.testing.assert_close(y, seen["y"])


def test_padded_keys_get_zero_weight():
    model = tiny_gpt(seed=3)
    T = 8
    idx = torch.randint(0, 50, (2, T))
    pad = torch.zeros(2, T, dtype=torch.bool)
    pad[0, :3] = True  # left padding: the prompt starts at column 3
    pad[1, 5] = True  # a hole in the middle
    pos = (torch.cumsum(~pad, dim=1) - 1).clamp(min=0)  # first real token at position 0
    maps = attention_maps(model, idx, key_padding_mask=pad, position_ids=pos)
    for w in maps:
        assert torch.all(w[0, :, :, :3] == 0)
        assert torch.all(w[1, :, :, 5] == 0)
        rows = w[0, :, 3:].sum(-1)  # real queries of row 0: weights still sum to 1
        torch.testing.assert_close(rows, torch.ones_like(rows))
        torch.testing.assert_close(w[1].sum(-1), torch.ones(TINY["n_head"], T))
        assert torch.all(w[0, :, :3] == 0)  # queries with no visible key: all zero, not NaN
    # the same prompt alone gives the same weights among its own tokens
    alone = attention_maps(model, idx[:1, 3:])
    for w, w_alone in zip(maps, alone, strict=True):
        torch.testing.assert_close(w[0, :, 3:, 3:], w_alone[0], atol=1e-6, rtol=1e-5)


def test_maps_leave_the_model_as_they_found_it():
    model = tiny_gpt(dropout=0.5).train()
    idx = torch.randint(0, 50, (1, 6))
    first, second = attention_maps(model, idx), attention_maps(model, idx)
    for a, b in zip(first, second, strict=True):  # eval mode inside: dropout off, repeatable
        torch.testing.assert_close(a, b)
    assert model.training
    assert all(not b.attn._forward_pre_hooks for b in model.blocks)


# --- labels, layout, PNG -------------------------------------------------------------------


def test_token_labels_make_whitespace_visible():
    class Decode:
        def decode(self, ids):
            return {0: " the", 1: "\n", 2: "cat ", 3: " ", 4: "a\tb"}[ids[0]]

    assert token_labels(Decode(), [0, 1, 2, 3, 4]) == ["␣the", "\\n", "cat␣", "␣", "a\\tb"]


def test_figure_layout_is_square_and_grows_with_tokens():
    assert figure_layout(12, 8)[:2] == (3, 4)
    assert figure_layout(4, 8)[:2] == (2, 2)
    assert figure_layout(1, 8)[:2] == (1, 1)
    assert figure_layout(2, 64)[2] > figure_layout(2, 8)[2]
    with pytest.raises(ValueError, match="at least one panel"):
        figure_layout(0, 8)


def test_select_panels_heads_or_layer_means():
    maps = attention_maps(tiny_gpt(), torch.randint(0, 50, (1, 5)))
    panels, titles = select_panels(maps, 1)
    assert len(panels) == TINY["n_head"] and titles[0] == "layer 1, head 0"
    torch.testing.assert_close(panels[1], maps[1][0, 1])
    panels, titles = select_panels(maps, "all")
    assert len(panels) == TINY["n_layer"]
    torch.testing.assert_close(panels[0], maps[0][0].mean(0))
    assert select_panels(maps, "-1")[1][0] == "layer 1, head 0"
    with pytest.raises(ValueError, match="out of range: the model has 2 layers"):
        select_panels(maps, 2)
    with pytest.raises(ValueError, match="integer or 'all'"):
        select_panels(maps, "first")


@pytest.mark.parametrize("layer,n_panels", [(0, TINY["n_head"]), ("all", TINY["n_layer"])])
def test_png_has_the_expected_pixel_size(tmp_path, layer, n_panels):
    from PIL import Image

    T = 12
    idx = torch.randint(0, 50, (1, T))
    maps = attention_maps(tiny_gpt(), idx)
    path = tmp_path / "heads.png"
    size = plot_attention(maps, token_labels(CharTokenizer(), idx[0].tolist()), path, layer)
    _, _, width, height = figure_layout(n_panels, T)
    assert size == (round(width * 100), round(height * 100))
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.size == size


def test_importing_the_package_does_not_import_matplotlib():
    code = ("import sys, minigpt, minigpt.viz, minigpt.viz.attention_maps, "
            "minigpt.viz.run_plots; assert 'matplotlib' not in sys.modules, 'matplotlib'")
    subprocess.run([sys.executable, "-c", code], check=True)
