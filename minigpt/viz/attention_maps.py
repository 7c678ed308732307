"""Attention maps: every layer's softmax weights for a prompt, and a PNG grid of heatmaps.
``attention_maps`` runs the model's own ``forward``, a pre-hook on each attention layer handing
its input to ``MultiHeadAttention.attention_weights``, so the maps see what training sees.

Shape letters: B batch, nh heads, T tokens (queries = keys), L layers.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from minigpt.sampling import evaluating

DPI = 100
READABLE_TOKENS = 64  # axis labels stay legible up to about this many tokens


def attention_maps(
    model, idx: Tensor, key_padding_mask: Tensor | None = None, position_ids: Tensor | None = None
) -> list[Tensor]:
    """L tensors (B, nh, T, T), every layer's attention weights for ``idx`` (B, T): row t holds
    how much query t attends to each key (0 above the diagonal and on padded keys). Runs in
    eval mode, then restores the model's mode."""
    maps: list[Tensor] = []

    def capture(attn, args, kwargs):
        # Block.forward calls attn(x, key_padding_mask, kv_cache, position_ids); accept keywords.
        x = args[0] if args else kwargs["x"]
        mask = args[1] if len(args) > 1 else kwargs.get("key_padding_mask")
        positions = args[3] if len(args) > 3 else kwargs.get("position_ids")
        maps.append(attn.attention_weights(x, mask, positions))  # (B, nh, T, T)

    handles = [attn.register_forward_pre_hook(capture, with_kwargs=True)
               for attn in model.attention_layers()]
    try:
        with evaluating(model):
            model(idx, key_padding_mask=key_padding_mask, position_ids=position_ids)
    finally:
        for handle in handles:
            handle.remove()
    return maps


def token_labels(tokenizer, ids: Sequence[int]) -> list[str]:
    """One axis label per token: spaces at either end shown as ``␣``, newlines and tabs as
    escapes, so every tick shows something."""
    labels = []
    for i in ids:
        text = tokenizer.decode([int(i)])
        text = text.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
        stripped = text.strip(" ")
        lead = len(text) - len(text.lstrip(" "))
        trail = len(text) - len(text.rstrip(" ")) if stripped else 0
        labels.append("␣" * lead + stripped + "␣" * trail)
    return labels


def figure_layout(n_panels: int, n_tokens: int) -> tuple[int, int, float, float]:
    """(rows, cols, width, height in inches) of an as-square-as-can-be grid of ``n_panels``
    T x T heatmaps, panels growing with T so tick labels do not overlap."""
    if n_panels < 1 or n_tokens < 1:
        raise ValueError(f"need at least one panel and one token, got {n_panels} and {n_tokens}")
    cols = math.ceil(math.sqrt(n_panels))
    rows = math.ceil(n_panels / cols)
    panel = min(max(1.5 + 0.12 * n_tokens, 3.0), 10.0)  # inches, including tick labels
    return rows, cols, cols * panel, rows * panel + 0.6  # + room for the title


def select_panels(maps: Sequence[Tensor], layer: int | str) -> tuple[list[Tensor], list[str]]:
    """The (T, T) heatmaps of the batch's first sequence and their titles: a panel per head of
    ``layer`` (an int), or per layer (mean of heads) for ``"all"``."""
    n_layer = len(maps)
    if layer == "all":
        return [m[0].mean(dim=0) for m in maps], [f"layer {i} (mean of heads)" for i in
                                                   range(n_layer)]
    if isinstance(layer, str):
        if not layer.lstrip("-").isdigit():
            raise ValueError(f"layer must be an integer or 'all', got {layer!r}")
        layer = int(layer)
    if not -n_layer <= layer < n_layer:
        raise ValueError(f"layer={layer} is out of range: the model has {n_layer} layers")
    layer %= n_layer
    weights = maps[layer][0]  # (nh, T, T)
    return list(weights), [f"layer {layer}, head {h}" for h in range(weights.shape[0])]


def plot_attention(
    maps: Sequence[Tensor], labels: Sequence[str], path: str | Path, layer: int | str = 0,
    title: str | None = None,
) -> tuple[int, int]:
    """Write a PNG grid of ``select_panels(maps, layer)`` (queries down, keys across); return
    its (width, height) in pixels."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt
    from matplotlib.colors import PowerNorm

    panels, titles = select_panels(maps, layer)
    T = panels[0].shape[-1]
    if len(labels) != T:
        raise ValueError(f"{len(labels)} labels for {T} tokens")
    rows, cols, width, height = figure_layout(len(panels), T)
    fontsize = 8 if T <= 32 else 6
    fig, axes = plt.subplots(rows, cols, figsize=(width, height), dpi=DPI, squeeze=False,
                             layout="constrained")
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    # sqrt colour scale: a head spreading 0.05 over 20 keys is still visible next to one at 1.0
    norm = PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0)
    image = None
    for ax, weights, panel_title in zip(axes.flat, panels, titles, strict=False):
        shown = weights.detach().float().cpu().masked_fill(~causal, float("nan"))  # blank future
        image = ax.imshow(shown.numpy(), cmap="viridis", norm=norm, interpolation="nearest")
        ax.set_title(panel_title, fontsize=9)
        ax.set_xticks(range(T), labels, rotation=90, fontsize=fontsize)
        ax.set_yticks(range(T), labels, fontsize=fontsize)
        ax.set_xlabel("key", fontsize=8)
        ax.set_ylabel("query", fontsize=8)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return round(width * DPI), round(height * DPI)


def write_attention_map(model, tokenizer, ids: Sequence[int], path: str | Path,
                        layer: int | str = 0, source: str = "model") -> str:
    """Plot ``model``'s attention over ``ids`` into the PNG ``path`` (float32, eval mode);
    return a one-line report."""
    if not ids:
        raise ValueError("the prompt is empty: attention maps need at least one token")
    context = model.config.context_length
    if len(ids) > context:
        raise ValueError(f"the prompt is {len(ids)} tokens; the model sees at most "
                         f"context_length={context}")
    if len(ids) > READABLE_TOKENS:
        print(f"note: {len(ids)} tokens; axis labels stay readable up to about "
              f"{READABLE_TOKENS}", file=sys.stderr)
    model = model.float().eval()
    device = next(model.parameters()).device
    maps = attention_maps(model, torch.tensor([list(ids)], device=device))
    title = f"{source}: " + ("all layers, mean of heads" if layer == "all" else f"layer {layer}")
    width, height = plot_attention([m.cpu() for m in maps], token_labels(tokenizer, ids), path,
                                   layer, title)
    return (f"wrote {path} ({width}x{height} px, {len(ids)} tokens, {len(maps)} layers, "
            f"{model.config.n_head} heads)")
