"""The model's hyperparameters: what a checkpoint stores to rebuild a model.

A plain dataclass that checks itself on construction, so a bad config (a Hydra override, a
checkpoint's metadata) is refused with every problem named before any weight is allocated.
``minigpt.model`` re-exports ``GPTConfig``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from minigpt.attention_checks import check_kv_heads, check_rope_theta
from minigpt.rope import check_rope_head_dim
from minigpt.window import check_window

POSITIONS = ("learned", "rope")


@dataclass
class GPTConfig:
    """Everything needed to rebuild a model; stored in checkpoints as a plain dict."""

    vocab_size: int = 50257
    context_length: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers, as GPT-2
    qkv_bias: bool = True  # GPT-2 has a QKV bias; the book trains from scratch without one
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02
    # The attention variants (the defaults are GPT-2's block; see minigpt.attention):
    num_kv_heads: int | None = None  # key/value heads (grouped-query); None: n_head
    position: str = "learned"  # learned: a position table (GPT-2); rope: rotary embeddings
    rope_theta: float = 10000.0  # rope's base wavelength
    window: int | None = None  # each token attends to its last `window` tokens; None: all

    def __post_init__(self):
        problems = self._size_problems() + self._variant_problems()
        if problems:
            raise ValueError("GPTConfig: " + "; ".join(problems))

    def _size_problems(self) -> list[str]:
        problems = []
        for name in ("vocab_size", "context_length", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                problems.append(f"{name}={value!r} must be a positive integer")
        if not problems and self.n_embd % self.n_head != 0:
            problems.append(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout={self.dropout!r} must be in [0, 1)")
        for name in ("bias", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name}={getattr(self, name)!r} must be true or false")
        for name in ("layer_norm_eps", "init_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                problems.append(f"{name}={value!r} must be a positive number")
        return problems

    def _variant_problems(self) -> list[str]:
        problems = []
        if self.num_kv_heads is not None:
            problems.append(check_kv_heads(self.num_kv_heads, self.n_head))
        if self.position not in POSITIONS:
            problems.append(f"position={self.position!r} must be one of {', '.join(POSITIONS)}")
        elif self.position == "rope" and isinstance(self.n_head, int) and self.n_head > 0 \
                and isinstance(self.n_embd, int) and self.n_embd % self.n_head == 0:
            problems.append(check_rope_head_dim(self.n_embd // self.n_head))
        problems.append(check_rope_theta(self.rope_theta))
        problems.append(check_window(self.window))
        return [p for p in problems if p]

    @property
    def kv_heads(self) -> int:
        """Key/value heads per layer (``n_head`` unless grouped)."""
        return self.n_head if self.num_kv_heads is None else self.num_kv_heads

    @classmethod
    def from_dict(cls, values: dict) -> GPTConfig:
        """Build from a mapping (a Hydra section, a checkpoint), naming unknown keys."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"GPTConfig: unknown field(s) {unknown}; valid fields are {sorted(known)}"
            )
        return cls(**dict(values))

    def to_dict(self) -> dict:
        return asdict(self)
