"""Sliding-window causal attention: each query sees its last ``window`` keys (itself included).

``banded_attention`` (training, prompts) takes the queries in chunks of ``C``, each attending to
the ``window + C`` keys ending with its last token: work and memory grow as T * (window + C), no
(T, T) mask. A window schedule grows the window over equal shares of training, held by the
layers as a tensor so a compiled graph does not recompile.

Shape letters: B batch, nh query heads, nkv key/value heads, T tokens, L keys, hd head dim,
n chunks, C chunk length, W window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 128  # queries per chunk: shorter is less work, longer overlaps fewer key spans (memory)


def check_window(window) -> str | None:
    """The problem with a ``window`` value, or None (None itself means full causal attention)."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        return f"window={window!r} must be a positive integer (or null for full causal attention)"
    return None


def window_mask(query_pos: Tensor, key_pos: Tensor, window: int | Tensor | None) -> Tensor:
    """(T, L) bool, True where the query at stream index ``query_pos`` may see the key at
    ``key_pos``: causal, within ``window`` (int, 0-dim tensor or None: any), not empty (-1)."""
    distance = query_pos[:, None] - key_pos[None, :]  # (T, L)
    allowed = (distance >= 0) & (key_pos[None, :] >= 0)
    return allowed if window is None else allowed & (distance < window)


def check_window_schedule(schedule, context_length, window) -> str | None:
    """The problem with a ``window_schedule``, or None: positive integers, none shrinking, the
    last ``context_length``, and no fixed ``window`` beside it."""
    if schedule is None:
        return None
    if isinstance(schedule, (str, bytes)) or not hasattr(schedule, "__len__") or not schedule \
            or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in schedule):
        return (f"window_schedule={schedule!r} must be a list of positive integers (the window "
                f"of each equal share of training, e.g. [128, 256, 384, 512]) or null")
    schedule = list(schedule)
    if any(b < a for a, b in zip(schedule, schedule[1:], strict=False)):
        return f"window_schedule={schedule} must not shrink: give the windows in growing order"
    if schedule[-1] != context_length:
        return (f"window_schedule={schedule} must end at the full context_length="
                f"{context_length} (the window the trained model decodes with); append "
                f"{context_length}")
    if window is not None:
        return (f"window_schedule={schedule} grows the window to the full context, so window="
                f"{window} must be null")
    return None


def scheduled_window(schedule: list[int], step: int, max_steps: int) -> int:
    """The window of step ``step`` (0-based) of ``max_steps``: each window takes an equal share
    of the steps, in order (steps past the end take the last)."""
    share = len(schedule) * step // max(max_steps, 1)
    return schedule[min(share, len(schedule) - 1)]


def follow_window_schedule(model, step: int, max_steps: int) -> int | None:
    """Set every attention layer of ``model`` to the scheduled window of ``step`` (an in-place
    fill, no recompile) and return it (None: no schedule)."""
    schedule = model.config.window_schedule
    if schedule is None:
        return None
    window = scheduled_window(schedule, step, max_steps)
    for layer in model.attention_layers():
        layer.set_window(window)
    return window


def finite_rows(mask: Tensor) -> tuple[Tensor, Tensor | None]:
    """Let a query with no visible key see them all (softmax stays finite); return the mask and
    those rows (..., 1), whose outputs the caller zeroes, or None when there are none."""
    empty = ~mask.any(dim=-1, keepdim=True)
    if empty.any():
        return mask | empty, empty
    return mask, None


def masked_attention(sdpa, q: Tensor, k: Tensor, v: Tensor, mask: Tensor,
                     dropout_p: float) -> Tensor:
    """``sdpa`` (the caller's) under ``mask`` (True = may attend); a query with no visible key
    returns zeros (softmax kept finite, never NaN)."""
    mask, empty = finite_rows(mask)
    y = sdpa(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    return y if empty is None else y.masked_fill(empty, 0.0)


def banded_attention(q: Tensor, k: Tensor, v: Tensor, window: int, padding: Tensor | None,
                     dropout_p: float, sdpa) -> Tensor:
    """Sliding-window causal attention of q (B, nh, T, hd) over k, v (B, nkv, T, hd) from
    position 0, ``padding`` (B, T) True at padded keys -> (B, nh, T, hd). ``sdpa``: the
    caller's (it handles nkv < nh)."""
    B, nh, T, hd = q.shape
    C = min(CHUNK, window)
    n = -(-T // C)  # chunks; the last one is padded with queries whose outputs are dropped
    qc = F.pad(q, (0, 0, 0, n * C - T)).view(B, nh, n, C, hd).transpose(1, 2)  # (B, n, nh, C, hd)
    qc = qc.reshape(B * n, nh, C, hd)
    kc, vc = (_key_spans(t, window, C, n) for t in (k, v))  # (B * n, nkv, W + C, hd)
    mask = _band(window, C, n, q.device)  # (n, C, W + C)
    if padding is not None:
        keep = ~F.pad(padding, (window, n * C - T), value=True).unfold(1, window + C, C)
        mask = mask & keep[:, :, None, :]  # (B, n, C, W + C)
    mask = mask.expand(B, n, C, window + C).reshape(B * n, 1, C, window + C)
    y = masked_attention(sdpa, qc, kc, vc, mask, dropout_p)  # (B * n, nh, C, hd)
    y = y.view(B, n, nh, C, hd).transpose(1, 2).reshape(B, nh, n * C, hd)
    return y[:, :, :T]


def _key_spans(t: Tensor, window: int, C: int, n: int) -> Tensor:
    """For each chunk j, the W + C keys at stream indices jC - W .. jC + C - 1 (zeros before the
    start): (B * n, nkv, W + C, hd)."""
    B, nkv, T, hd = t.shape
    padded = F.pad(t, (0, 0, window, n * C - T))  # (B, nkv, W + n C, hd)
    spans = padded.unfold(2, window + C, C)  # (B, nkv, n, hd, W + C), a view
    return spans.permute(0, 2, 1, 4, 3).reshape(B * n, nkv, window + C, hd)


def _band(window: int, C: int, n: int, device) -> Tensor:
    """(n, C, W + C) bool: query a of chunk j (index jC + a) may see span key b (index
    jC - W + b): causal (b <= a + W), within the window (b > a) and not before the start."""
    a = torch.arange(C, device=device)[:, None]
    b = torch.arange(window + C, device=device)[None, :]
    j = torch.arange(n, device=device)[:, None, None]
    return (b <= a + window) & (b > a) & (b >= window - j * C)
