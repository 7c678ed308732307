"""The GPT-2-style language model: embeddings, pre-LayerNorm blocks, tied LM head (torch only).

The modern recipe's block options are ``GPTConfig`` fields, each off by default, so
``GPTConfig()`` is GPT-2 exactly. Shape letters: B batch, T tokens, C = n_embd, V = vocab_size.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minigpt import sampling
from minigpt.attention import MultiHeadAttention, check_context_fits, check_kv_heads
from minigpt.documents import check_document_ids, document_positions
from minigpt.field_rules import OneOf, Range, field_problems
from minigpt.kv_cache import KVCache, LayerCache
from minigpt.rope import check_rope_head_dim
from minigpt.window import check_window_schedule

IGNORE_INDEX = -100  # a target that does not count in the loss (F.cross_entropy's default)


def gelu_tanh(x: Tensor) -> Tensor:
    """GPT-2's activation: GELU with the tanh approximation."""
    return F.gelu(x, approximate="tanh")


def relu_squared(x: Tensor) -> Tensor:
    """ReLU²: relu(x)**2 (Primer, So et al. 2021; the modded-nanogpt speedrun and nanochat)."""
    return F.relu(x).square()


ACTIVATIONS = {"gelu": gelu_tanh, "relu2": relu_squared}  # GPTConfig.mlp -> activation


def make_norm(config: GPTConfig) -> nn.Module:
    """The normalization of ``config.norm`` over C features: GPT-2's LayerNorm, or RMSNorm with
    a learned gain (as LayerNorm's weight) and no bias."""
    C = config.n_embd
    if config.norm == "rmsnorm":
        return nn.RMSNorm(C, eps=config.layer_norm_eps, elementwise_affine=True)
    return nn.LayerNorm(C, eps=config.layer_norm_eps, bias=config.bias)


def softcap(logits: Tensor, cap: float | None) -> Tensor:
    """``cap * tanh(logits / cap)``: logits squashed smoothly into (-cap, cap); None: unchanged."""
    return logits if cap is None else cap * torch.tanh(logits / cap)


class FeedForward(nn.Module):
    """Linear(C, 4C) -> GELU (tanh approximation, as GPT-2; or ReLU²) -> Linear(4C, C)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.activation = ACTIVATIONS[config.mlp]

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.activation(self.fc(x)))


class NextTokenLoss(nn.Module):
    """Mean cross-entropy of the LM head's logits (soft-capped with ``logit_softcap``) against
    the targets, in float32. A module of its own so that a speedup can swap in a kernel that
    never materializes the (B, T, V) logits (``minigpt.cpu.speed_up_training``)."""

    def __init__(self, logit_softcap: float | None = None):
        super().__init__()
        self.logit_softcap = logit_softcap

    def forward(self, hidden: Tensor, head: nn.Linear, targets: Tensor,
                ignore_index: int = IGNORE_INDEX) -> Tensor:
        logits = softcap(head(hidden).float(), self.logit_softcap)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                               ignore_index=ignore_index)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        C = config.n_embd
        self.norm1 = make_norm(config)
        self.attn = MultiHeadAttention(
            C, C, config.context_length, config.dropout, config.n_head, config.qkv_bias,
            out_bias=config.bias, num_kv_heads=config.num_kv_heads,
            rope=config.position == "rope", rope_theta=config.rope_theta, window=config.window,
            qk_norm=config.qk_norm, qk_norm_eps=config.layer_norm_eps,
            scheduled_window=config.window_schedule is not None,
        )
        self.norm2 = make_norm(config)
        self.mlp = FeedForward(config)
        self.drop = nn.Dropout(config.dropout)  # on each residual branch, as GPT-2

    def forward(
        self, x: Tensor, key_padding_mask: Tensor | None = None,
        kv_cache: LayerCache | None = None, position_ids: Tensor | None = None,
        value_embedding: Tensor | None = None, document_ids: Tensor | None = None,
    ) -> Tensor:
        x = x + self.drop(self.attn(self.norm1(x), key_padding_mask, kv_cache, position_ids,
                                    value_embedding, document_ids))
        return x + self.drop(self.mlp(self.norm2(x)))


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
    # The window of each equal share of training, growing to context_length, e.g. [128, 256, 512]
    window_schedule: list[int] | None = None
    # The block options of the modern recipe (the defaults are GPT-2's):
    norm: str = "layernorm"  # layernorm (GPT-2) | rmsnorm: both block norms and the final one
    qk_norm: bool = False  # queries and keys scaled to unit RMS per head before attending
    mlp: str = "gelu"  # gelu (tanh approximation, GPT-2) | relu2: relu(x)**2
    tie_head: bool = True  # the LM head is the token embedding; False: its own, zero-initialized
    zero_init_proj: bool = False  # attention output and MLP down projections start at zero
    logit_softcap: float | None = None  # logits = cap * tanh(logits / cap); None: no cap
    value_embeddings: bool = False  # every other layer adds a token-indexed table to its values
    document_mask: bool = False  # train on packed rows of documents, each attended alone

    def __post_init__(self):
        # each field against its type and GPT_CONFIG_RULES, then the rules across fields
        problems = field_problems(self, GPT_CONFIG_RULES) + self.spanning_problems()
        if problems:
            raise ValueError("GPTConfig: " + "; ".join(problems))

    @property
    def kv_heads(self) -> int:
        """Key/value heads per layer (``n_head`` unless grouped)."""
        return self.n_head if self.num_kv_heads is None else self.num_kv_heads

    @property
    def value_embedding_layers(self) -> tuple[int, ...]:
        """The layers with a value embedding: every other one, counted back from the last (the
        placement nanochat uses), so a model of L layers has (L + 1) // 2 tables."""
        if not self.value_embeddings:
            return ()
        return tuple(range(self.n_layer - 1, -1, -2))[::-1]

    def num_params(self, include_position: bool = True) -> int:
        """Parameters of ``GPT(self)``, a tied head counted once; without the position table for
        ``include_position=False`` (scaling-law papers). Arithmetic: no model is built."""
        C, V = self.n_embd, self.vocab_size
        kv_features = self.kv_heads * (C // self.n_head)
        qkv_out = C + 2 * kv_features  # queries, then keys and values of kv_heads heads
        weights = qkv_out * C + C * C + 8 * C * C  # qkv, out_proj, fc and proj
        biases = qkv_out * self.qkv_bias + 6 * C * self.bias  # qkv; out_proj (C), fc (4C), proj (C)
        norm = 2 * C if self.norm == "layernorm" and self.bias else C  # gain (and LayerNorm's bias)
        learned = self.position == "learned" and include_position
        positions = self.context_length * C if learned else 0
        head = 0 if self.tie_head else V * C
        tables = len(self.value_embedding_layers) * V * kv_features
        blocks = self.n_layer * (weights + biases + 2 * norm)
        return V * C + positions + blocks + norm + head + tables

    @classmethod
    def from_dict(cls, values: dict) -> GPTConfig:
        """Build from a mapping (a Hydra section, a checkpoint), naming unknown keys."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"GPTConfig: unknown field(s) {unknown}; valid fields are "
                             f"{sorted(known)}")
        return cls(**dict(values))

    def to_dict(self) -> dict:
        return asdict(self)

    def spanning_problems(self) -> list[str]:
        """The rules across fields (each once the sizes it needs are valid)."""
        problems = [check_window_schedule(self.window_schedule, self.context_length, self.window)]
        sizes = (self.n_head, self.n_embd)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
            return [p for p in problems if p]
        problems.append(check_kv_heads(self.num_kv_heads, self.n_head)
                        if self.num_kv_heads is not None else None)
        if self.n_embd % self.n_head != 0:
            problems.append(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        elif self.position == "rope":
            problems.append(check_rope_head_dim(self.n_embd // self.n_head))
        return [p for p in problems if p]


class GPT(nn.Module):
    """GPT-2: token + learned position embeddings, ``n_layer`` blocks, final LayerNorm, and an
    LM head that shares its weight with the token embedding; ``GPTConfig`` options swap in rotary
    positions (no table), an untied head, value embeddings on every other layer."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        C = config.n_embd
        self.tok_emb = nn.Embedding(config.vocab_size, C)
        self.pos_emb = nn.Embedding(config.context_length, C) \
            if config.position == "learned" else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        kv_features = config.kv_heads * (C // config.n_head)
        # keyed by layer index; lookups, not matmuls: AdamW's embedding group steps them
        self.value_embeds = nn.ModuleDict({
            str(layer): nn.Embedding(config.vocab_size, kv_features)
            for layer in config.value_embedding_layers})
        self.final_norm = make_norm(config)
        self.lm_head = nn.Linear(C, config.vocab_size, bias=False)
        if config.tie_head:
            self.lm_head.weight = self.tok_emb.weight  # tied, as GPT-2
        self.next_token_loss = NextTokenLoss(config.logit_softcap)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialization: N(0, 0.02) everywhere, residual output projections scaled by
        1/sqrt(2 * n_layer). Then (after GPT-2's draws, so every other weight is GPT-2's)
        ``zero_init_proj`` zeroes those projections and an untied head starts at zero."""
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                nn.init.ones_(module.weight)  # make_norm's always have a gain
            if getattr(module, "bias", None) is not None:  # Linear's and LayerNorm's
                nn.init.zeros_(module.bias)
        residual_std = std / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            for proj in (block.attn.out_proj, block.mlp.proj):
                nn.init.normal_(proj.weight, mean=0.0, std=residual_std)
                if self.config.zero_init_proj:
                    nn.init.zeros_(proj.weight)
        if not self.config.tie_head:
            nn.init.zeros_(self.lm_head.weight)

    def forward(
        self,
        idx: Tensor,
        key_padding_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        kv_cache: KVCache | None = None,
        last_only: bool = False,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Logits (B, T, V) for token ids ``idx`` (B, T); (B, 1, V) for the last position only
        with ``last_only``. ``position_ids`` (B, T) defaults to 0..T-1, or with ``kv_cache``
        (``new_kv_cache``) to the positions after the cached tokens; left-padded batches pass
        their own. ``document_ids`` (B, T): see ``hidden_states``."""
        x = self.hidden_states(idx, key_padding_mask, position_ids, kv_cache, document_ids)
        if last_only:
            x = x[:, -1:]  # (B, 1, C)
        return self.logits(x)  # (B, T, V)

    def logits(self, hidden: Tensor) -> Tensor:
        """The LM head on final hidden states (..., C) -> (..., V), soft-capped: the one place
        logits are made."""
        return softcap(self.lm_head(hidden), self.config.logit_softcap)

    def loss(
        self,
        idx: Tensor,
        targets: Tensor,
        key_padding_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        ignore_index: int = IGNORE_INDEX,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Mean next-token cross-entropy (float32 scalar) of ``idx`` (B, T) against ``targets``
        (B, T); targets equal to ``ignore_index`` do not count. The value of
        ``F.cross_entropy(model(idx).flatten(0, 1).float(), targets.flatten())``."""
        if targets.shape != idx.shape:
            raise ValueError(f"targets must have the shape of idx {tuple(idx.shape)}, "
                             f"got {tuple(targets.shape)}")
        x = self.hidden_states(idx, key_padding_mask, position_ids,
                               document_ids=document_ids)  # (B, T, C)
        return self.next_token_loss(x, self.lm_head, targets, ignore_index)

    def hidden_states(
        self,
        idx: Tensor,
        key_padding_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        kv_cache: KVCache | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """The final-LayerNorm output (B, T, C) that the LM head turns into logits.
        ``document_ids`` (B, T) int (``document_mask`` models only): ``idx`` is a packed row of
        documents, each computed as if alone (``minigpt.documents``)."""
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (batch, tokens), got {tuple(idx.shape)}")
        T = idx.shape[1]
        if document_ids is not None:
            if not self.config.document_mask:
                raise ValueError("document_ids were given to a model built with "
                                 "document_mask=false; set model.document_mask=true")
            check_document_ids(document_ids, idx.shape[0], T)
        if position_ids is None:
            tokens = T if kv_cache is None else kv_cache.total_after(T)
            if not self.unbounded and tokens is not None:
                check_context_fits(tokens, self.config.context_length)
            if document_ids is not None:
                position_ids = document_positions(document_ids)  # (B, T)
            elif kv_cache is None:
                position_ids = torch.arange(T, device=idx.device)[None]  # (1, T)
        layers = [None] * len(self.blocks)
        if kv_cache is not None:  # the cache learns of the new tokens once; the blocks only write
            position_ids = kv_cache.advance(T, key_padding_mask, position_ids)  # (1 or B, T)
            layers = kv_cache.layers
        x = self.tok_emb(idx)  # (B, T, C)
        if self.pos_emb is not None:  # learned positions; rope's enter in the attention
            x = x + self.pos_emb(position_ids)
        x = self.drop(x)
        for i, (block, layer_cache) in enumerate(zip(self.blocks, layers, strict=True)):
            # added to the layer's values (the modded-nanogpt speedrun, nanochat); None: no table
            ve = self.value_embeds[str(i)](idx) if str(i) in self.value_embeds else None
            x = block(x, key_padding_mask, layer_cache, position_ids, ve, document_ids)
        return self.final_norm(x)

    def attention_layers(self) -> list[MultiHeadAttention]:
        """Every block's attention, in order (what attention maps and window schedules use)."""
        return [block.attn for block in self.blocks]

    @property
    def unbounded(self) -> bool:
        """Rotary positions with a sliding window: any length runs, with a bounded KV cache, so
        generation goes past ``context_length`` without cropping."""
        return self.config.position == "rope" and self.config.window is not None

    def kv_cache_capacity(self, capacity: int | None = None) -> int:
        """Tokens each layer's cache holds: ``capacity`` (default ``context_length``), or the
        window for a sliding-window model (at most ``capacity`` unless ``unbounded``)."""
        c = self.config
        capacity = capacity or c.context_length
        if c.window is None:
            return capacity
        return c.window if self.unbounded else min(c.window, capacity)

    def new_kv_cache(self, batch_size: int, capacity: int | None = None, *, sliced: bool = True,
                     device=None, dtype=None, cache_class: type[KVCache] = KVCache) -> KVCache:
        """The KV cache of every block, holding up to ``kv_cache_capacity(capacity)`` tokens (a
        ring of ``window`` slots for a sliding-window model: its size never grows). ``sliced``:
        see ``KVCache`` (False: fixed shapes, for a captured graph); ``cache_class``: a
        ``KVCache`` subclass to build (the server's ``BatchCache``)."""
        c = self.config
        weight = self.tok_emb.weight
        return cache_class(batch_size, c.n_layer, c.kv_heads, self.kv_cache_capacity(capacity),
                           c.n_embd // c.n_head, window=c.window, sliced=sliced,
                           device=device or weight.device, dtype=dtype or weight.dtype)

    def kv_cache_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes the KV cache holds per cached token (keys and values of every layer)."""
        c = self.config
        itemsize = (dtype or self.tok_emb.weight.dtype).itemsize
        return 2 * c.n_layer * c.kv_heads * (c.n_embd // c.n_head) * itemsize

    def num_params(self, include_position: bool = True) -> int:
        """See ``GPTConfig.num_params``."""
        return self.config.num_params(include_position)

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward), for MFU: 6 N for the matmul weights
        (not lookups: an untied token embedding, value embeddings) plus 12 L T C for attention
        (Kaplan et al. 2020; PaLM appendix B), T capped at the window."""
        c = self.config
        T = seq_len or c.context_length
        T = T if c.window is None else min(T, c.window)
        matmul_params = self.num_params(include_position=False)
        if not c.tie_head:
            matmul_params -= self.tok_emb.weight.numel()
        matmul_params -= sum(p.numel() for p in self.value_embeds.parameters())
        return 6 * matmul_params + 12 * c.n_layer * T * c.n_embd

    # Interop and sampling live in their own modules (minigpt.hf, minigpt.sampling), which never
    # import this one; these are the entry points nanoGPT and transformers users reach for.
    @classmethod
    def from_pretrained(cls, name_or_path: str, **config_overrides) -> GPT:
        """A float32 model in eval mode from a Hugging Face GPT-2 directory or hub name (e.g.
        ``gpt2``); ``config_overrides``: see ``minigpt.hf.read_gpt2``."""
        from minigpt import hf

        fields, state = hf.read_gpt2(name_or_path, **config_overrides)
        with torch.device("meta"):  # no init work: every tensor is replaced by a loaded one
            model = cls(GPTConfig.from_dict(fields))
        model.load_state_dict(state, strict=True, assign=True)
        model.lm_head.weight = model.tok_emb.weight  # assign=True replaced the tied Parameter
        return model.eval()

    def save_pretrained(self, path: str) -> None:
        """Write a Hugging Face GPT-2 directory (``config.json`` + ``model.safetensors``)."""
        from minigpt import hf

        hf.write_gpt2(path, self.config.to_dict(), self.state_dict())

    # model.generate(idx, max_new_tokens, ...): nanoGPT's spelling of sampling.generate(model, ...)
    generate = sampling.generate


# --------------------------------------------------------------------------- GPTConfig's rules

# The one table of GPTConfig's single-field rules (its types come from the annotations); the
# training config's model.* checks are these too (minigpt.config.rules).
GPT_CONFIG_RULES = {
    **dict.fromkeys(("vocab_size", "context_length", "n_layer", "n_head", "n_embd", "window"),
                    Range(1)),
    "dropout": Range(0, 1, high_open=True),
    **dict.fromkeys(("layer_norm_eps", "init_std", "rope_theta", "logit_softcap"),
                    Range(0, low_open=True)),
    "position": OneOf(("learned", "rope")), "norm": OneOf(("layernorm", "rmsnorm")),
    "mlp": OneOf(tuple(ACTIVATIONS)),
}
