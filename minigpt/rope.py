"""Rotary position embeddings (RoPE, Su et al. 2021), for ``MultiHeadAttention(rope=True)``:
pair ``(x[i], x[i + hd/2])`` of each query and key head ("rotate half", as GPT-NeoX and Llama)
turns by ``position * theta**(-2i/hd)``, in float32. Shape letters: B batch, h heads, T tokens,
hd head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_rope_head_dim(head_dim: int) -> str | None:
    """The problem with rotating heads of ``head_dim`` features, or None."""
    if head_dim % 2:
        return f"rope needs an even head dimension, got head_dim={head_dim}"
    return None


def check_rope_theta(rope_theta) -> str | None:
    """The problem with rope's base wavelength, or None."""
    if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) \
            or not rope_theta > 0:
        return f"rope_theta={rope_theta!r} must be a positive number"
    return None


def rope_angles(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of every pair's angle: (B, 1, T, hd/2) float32 for positions (B, T)."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
    inv_freq = theta ** (-exponents / head_dim)  # (hd/2,)
    angles = positions.to(torch.float32)[:, None, :, None] * inv_freq  # (B, 1, T, hd/2)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x`` (B, h, T, hd) with each pair rotated by its angle (float32 math, ``x``'s dtype)."""
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, h, T, hd/2) each
    rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return rotated.to(x.dtype)
