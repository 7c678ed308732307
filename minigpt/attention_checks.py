"""Argument checks of the attention block, shared with ``GPTConfig``.

Each check returns the problem as one line naming the bad value (or None), so a caller can
report every problem of a constructor call or a config at once.
"""

from __future__ import annotations

from minigpt.rope import check_rope_head_dim
from minigpt.window import check_window


def check_sizes(d_in, d_out, context_length, num_heads, dropout) -> list[str]:
    """Problems with the book's constructor arguments."""
    problems = []
    for name, value in (("d_in", d_in), ("d_out", d_out), ("context_length", context_length),
                        ("num_heads", num_heads)):
        if not isinstance(value, int) or value <= 0:
            problems.append(f"{name}={value!r} must be a positive integer")
    if not problems and d_out % num_heads != 0:
        problems.append(f"d_out={d_out} must be divisible by num_heads={num_heads}")
    if not 0.0 <= float(dropout) < 1.0:
        problems.append(f"dropout={dropout} must be in [0, 1)")
    return problems


def check_variants(head_dim, num_heads, num_kv_heads, rope, rope_theta, window) -> list[str]:
    """Problems with the variant keywords (for valid sizes)."""
    problems = [check_kv_heads(num_kv_heads, num_heads), check_window(window)]
    if rope:
        problems += [check_rope_head_dim(head_dim), check_rope_theta(rope_theta)]
    return [p for p in problems if p]


def check_kv_heads(num_kv_heads, num_heads) -> str | None:
    """The problem with ``num_kv_heads`` key/value heads for ``num_heads`` query heads, or None."""
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) \
            or not isinstance(num_heads, int) or not 1 <= num_kv_heads <= max(num_heads, 1):
        return f"num_kv_heads={num_kv_heads!r} must be an integer in [1, num_heads={num_heads}]"
    if num_heads % num_kv_heads:
        return f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}"
    return None


def check_rope_theta(rope_theta) -> str | None:
    """The problem with rope's base wavelength, or None."""
    if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) \
            or not rope_theta > 0:
        return f"rope_theta={rope_theta!r} must be a positive number"
    return None


def check_context_fits(tokens: int, context_length: int) -> None:
    """Refuse more tokens than the model was built to see, naming the fix."""
    if tokens > context_length:
        raise ValueError(f"{tokens} tokens exceed context_length={context_length}; "
                         "crop the input to the last context_length tokens")
