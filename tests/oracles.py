"""Independent oracles, written once: the tests check minigpt against them, and the benchmarks
(``python -m bench.<name>``, which import ``tests.oracles``) time or check against the same ones.

* ``BookMultiHeadAttention``: the book's chapter-3 class, unfused (three projections, a
  materialized T x T mask buffer, softmax by hand); ``MultiHeadAttention`` loads its state dict.
* The formula GPT (``ref_hidden``, ``ref_logits``, ``ref_attention``, ...): a GPT written out from
  the formulas, every option of ``GPTConfig``, reading a model's state dict; heads looped over.
* ``reference_cross_entropy``: the LM head and the cross-entropy in the plain formulation
  (full logits, ``F.cross_entropy``) that every fused or chunked loss must equal.

Plain torch only: nothing here imports minigpt.
Shape letters: B batch, T tokens, C model width, V vocabulary, nh heads, hd head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# --- the book's attention ---------------------------------------------------------------------


class BookMultiHeadAttention(nn.Module):
    """The book's chapter-3 layout: three projections, a materialized T x T mask buffer, the
    softmax over explicit scores. Written independently of ``minigpt.attention``."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        b, num_tokens, _ = x.shape
        keys, queries, values = self.W_key(x), self.W_query(x), self.W_value(x)
        keys = keys.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        values = values.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        attn_scores = queries @ keys.transpose(2, 3)  # (b, nh, T, T)
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores.masked_fill_(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        context = (attn_weights @ values).transpose(1, 2)
        context = context.contiguous().view(b, num_tokens, self.d_out)
        return self.out_proj(context)


# --- the reference cross-entropy --------------------------------------------------------------


def reference_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor,
                            ignore_index: int = -100, softcap: float | None = None) -> Tensor:
    """Mean cross-entropy of the logits ``h @ weight.T`` (N, V), soft-capped when asked,
    against ``targets`` (N,), over the full float32 logits."""
    logits = (h @ weight.t()).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits_cross_entropy(logits, targets, ignore_index)


def logits_cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean next-token cross-entropy of logits (B, T, V) or (N, V) against targets (B, T) or
    (N,), in float32: the value ``GPT.loss`` returns."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(),
                           ignore_index=ignore_index)


# --- the formula GPT: reading a model's state dict ---------------------------------------------


def ref_norm(x, sd, prefix, cfg):
    eps = cfg.layer_norm_eps
    if cfg.norm == "rmsnorm":
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * sd[prefix + ".weight"]
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * sd[prefix + ".weight"] + sd.get(prefix + ".bias", 0)


def ref_rms_heads(x, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def ref_rope(x, theta):
    """Pair (x[i], x[i + hd/2]) as a complex number turned by position * theta**(-2i/hd)."""
    T, hd = x.shape[-2], x.shape[-1]
    angle = torch.arange(T, dtype=torch.float64)[:, None] \
        * theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # (T, hd/2)
    z = torch.complex(*x.double().chunk(2, dim=-1)) * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


def ref_attention(x, sd, prefix, cfg, norm_after_rope=False, value_rows=None):
    """(output (B, T, C), weights (B, nh, T, T)) of one layer, every head looped over;
    ``value_rows`` (B, T, nkv * hd): the layer's value-embedding rows, added to the values."""
    B, T, C = x.shape
    nh, nkv = cfg.n_head, cfg.kv_heads
    hd = C // nh
    qkv = x @ sd[prefix + "qkv.weight"].T + sd.get(prefix + "qkv.bias", 0)
    q, k, v = qkv.split([C, nkv * hd, nkv * hd], dim=-1)
    if value_rows is not None:
        v = v + value_rows
    q = q.view(B, T, nh, hd).transpose(1, 2)
    k, v = (t.view(B, T, nkv, hd).transpose(1, 2) for t in (k, v))
    steps = [lambda t: ref_rms_heads(t, cfg.layer_norm_eps)] if cfg.qk_norm else []
    if cfg.position == "rope":
        rope = [lambda t: ref_rope(t, cfg.rope_theta)]
        steps = rope + steps if norm_after_rope else steps + rope
    for step in steps:
        q, k = step(q), step(k)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    visible = (j <= i) & ((j > i - cfg.window) if cfg.window else True)
    weights, outputs = [], []
    for h in range(nh):
        g = h // (nh // nkv)  # the key/value head of query head h
        scores = q[:, h] @ k[:, g].transpose(-1, -2) / math.sqrt(hd)  # (B, T, T)
        w = scores.masked_fill(~visible, -math.inf).softmax(-1)
        weights.append(w)
        outputs.append(w @ v[:, g])
    y = torch.cat(outputs, dim=-1)  # (B, T, C), heads side by side
    return y @ sd[prefix + "out_proj.weight"].T + sd.get(prefix + "out_proj.bias", 0), \
        torch.stack(weights, 1)


def ref_activation(x, mlp):
    if mlp == "relu2":
        return torch.where(x > 0, x * x, torch.zeros_like(x))
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def ref_hidden(model, idx):
    """The final norm's output and every layer's attention weights."""
    cfg, sd = model.config, model.state_dict()
    x = sd["tok_emb.weight"][idx]
    if cfg.position == "learned":
        x = x + sd["pos_emb.weight"][: idx.shape[1]]
    maps = []
    for i in range(cfg.n_layer):
        p = f"blocks.{i}."
        table = sd.get(f"value_embeds.{i}.weight")
        a, w = ref_attention(ref_norm(x, sd, p + "norm1", cfg), sd, p + "attn.", cfg,
                             value_rows=None if table is None else table[idx])
        x, maps = x + a, maps + [w]
        h = ref_norm(x, sd, p + "norm2", cfg) @ sd[p + "mlp.fc.weight"].T \
            + sd.get(p + "mlp.fc.bias", 0)
        x = x + ref_activation(h, cfg.mlp) @ sd[p + "mlp.proj.weight"].T \
            + sd.get(p + "mlp.proj.bias", 0)
    return ref_norm(x, sd, "final_norm", cfg), maps


def ref_logits(model, idx):
    cfg = model.config
    logits = ref_hidden(model, idx)[0] @ model.state_dict()["lm_head.weight"].T
    cap = cfg.logit_softcap
    return logits if cap is None else cap * torch.tanh(logits / cap)
