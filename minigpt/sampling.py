"""Logits -> next token (temperature, top-k, top-p), pure functions of (B, V) logits; and
``generate``: the prompt in one forward pass, then one token per step over the KV cache.

The context window: each row conditions on its tokens from its first real one (the last
``context_length`` of a longer prompt, with a warning). When a new token would overflow the
context, the window is cropped to its last ``crop_to`` tokens (default ``context_length // 2``)
and the cache refilled with one forward pass, the tokens at positions 0, 1, ...;
``use_cache=False`` runs the model on the same windows, so both paths agree token for token.
A rotary sliding-window model (``model.unbounded``) is never cropped: its ring cache keeps the
last ``window`` tokens.

Shape letters: B batch, T prompt tokens, N tokens so far, L window tokens, V vocabulary.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import Tensor

__all__ = [
    "apply_temperature",
    "evaluating",
    "generate",
    "pad_prompts",
    "sample_next",
    "top_k_filter",
    "top_p_filter",
    "validate_sampling",
]


def validate_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise one ValueError naming every invalid sampling value."""
    problems = []
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not temperature >= 0:  # `not >=` also rejects NaN
        problems.append(f"temperature={temperature!r} must be >= 0 (0 means greedy)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        problems.append(f"top_k={top_k!r} must be an integer >= 1 (or null for no limit)")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        problems.append(f"top_p={top_p!r} must be in (0, 1] (or null for no limit)")
    if problems:
        raise ValueError("; ".join(problems))


def apply_temperature(logits: Tensor, temperature: float) -> Tensor:
    """``logits / temperature`` for temperature > 0 (temperature 0 is greedy: use argmax)."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0 to scale logits")
    return logits if temperature == 1 else logits / temperature


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the ``k`` largest logits of each row (and any tied with the k-th); the rest -> -inf."""
    validate_sampling(1.0, k, None)
    if k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose probability reaches
    ``p`` (a token is dropped when the tokens ranked above it already reach ``p``; the most
    likely token is always kept); the rest -> -inf."""
    validate_sampling(1.0, None, p)
    if p == 1:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
    probs = sorted_logits.float().softmax(dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked higher
    drop_sorted = mass_above >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def sample_next(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Next token ids (B,) from last-position logits (B, V).

    Temperature 0 is greedy (argmax; ``top_k``/``top_p`` cannot change it). Otherwise the logits
    are divided by the temperature, filtered by top-k then top-p, and one token is drawn per row
    with ``generator`` (seed it for reproducible samples).
    """
    validate_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = apply_temperature(logits.float(), temperature)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def pad_prompts(
    prompts: Sequence[Sequence[int]], pad_id: int = 0, *, device=None
) -> tuple[Tensor, Tensor]:
    """Left-pad prompts of different lengths: ids (B, T) and ``key_padding_mask`` (B, T), True
    where a position is padding, as ``generate`` expects."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    T = max(len(p) for p in prompts)
    idx = torch.full((len(prompts), T), pad_id, dtype=torch.long, device=device)
    mask = torch.ones(len(prompts), T, dtype=torch.bool, device=device)
    for row, p in enumerate(prompts):
        idx[row, T - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[row, T - len(p):] = False
    return idx, mask


@contextlib.contextmanager
def evaluating(model):
    """Eval mode and no autograd inside; the model's training flag as it was afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


@torch.inference_mode()
def generate(
    model,
    idx: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    *,
    key_padding_mask: Tensor | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    on_token: Callable[[Tensor], None] | None = None,
    vocab_size: int | None = None,
    crop_to: int | None = None,
    decoder=None,
) -> Tensor:
    """Append up to ``max_new_tokens`` sampled tokens to ``idx`` (B, T); return (B, T + n).

    Args:
        model: a ``GPT`` (anything with ``config.context_length``, ``new_kv_cache`` and
            ``forward(idx, key_padding_mask, position_ids, kv_cache, last_only=)``). It runs in
            eval mode; its training flag is restored afterwards.
        temperature, top_k, top_p, generator: see ``sample_next``.
        eos_id: a row that produces it is finished: its later positions are filled with
            ``eos_id``, and the loop stops early once every row is finished.
        key_padding_mask: (B, T) bool, True at padding, for prompts of different lengths; the
            padding must be on the left (see ``pad_prompts``). Each row gets the tokens it
            would get alone: its first real token sits at position 0 and padding gets no weight.
        use_cache: decode with the KV cache (the default) or rerun the model on the whole
            window every step (the reference the cache must match).
        on_token: called with the new tokens (B,) after every step, for streaming.
        vocab_size: only ids below it are ever sampled (a model's vocabulary may be padded
            beyond its tokenizer's).
        crop_to: tokens kept when the window is full (see the module docstring).
        decoder: a ``minigpt.static_decoding.StaticDecoder`` of this model and batch size, with
            room for the prompt and ``max_new_tokens`` (or the context): the one-token steps run
            over its fixed-shape (compiled) cache instead of the eager one; the tokens are the same.
    """
    validate_sampling(temperature, top_k, top_p)
    B, T, pad_counts = _check_generate_inputs(model, idx, max_new_tokens, key_padding_mask,
                                              vocab_size, crop_to)
    # the most tokens a row's window holds; no limit for rope + sliding window (model.unbounded)
    ctx = math.inf if getattr(model, "unbounded", False) else model.config.context_length
    _check_decoder(decoder, model, B, use_cache, min(ctx, T + max_new_tokens))
    keep = crop_to if crop_to is not None else max(1, model.config.context_length // 2)
    # Window start (a column of `out`) per row, as python ints: no device syncs in the loop.
    starts = [max(pad, T - ctx) for pad in pad_counts]
    if T - ctx > min(pad_counts):
        warnings.warn(f"prompt is longer than context_length={ctx}; conditioning on its last "
                      f"{ctx} tokens", stacklevel=2)  # never for an unbounded model (ctx = inf)
    if max_new_tokens == 0:
        return idx.clone()
    out = torch.empty(B, T + max_new_tokens, dtype=torch.long, device=idx.device)
    out[:, :T] = idx
    sample = partial(sample_next, temperature=temperature, top_k=top_k, top_p=top_p,
                     generator=generator)
    with evaluating(model):
        N = _decode(model, out, T, starts, ctx, keep, sample, eos_id=eos_id, use_cache=use_cache,
                    on_token=on_token, vocab_size=vocab_size, decoder=decoder)
    return out[:, :N]


def _decode(model, out: Tensor, T: int, starts: list[int], ctx: float, keep: int, sample, *,
            eos_id, use_cache: bool, on_token, vocab_size, decoder) -> int:
    """Fill ``out[:, T:]`` one sampled token per step, cropping a row's window past ``ctx``
    tokens to its last ``keep``; return the number of columns filled (fewer than ``out``'s when
    every row has produced ``eos_id``)."""
    B, total = out.shape
    finished = torch.zeros(B, dtype=torch.bool, device=out.device) if eos_id is not None else None
    cache = None
    if use_cache:
        cache = model.new_kv_cache(B) if decoder is None else decoder.cache
        cache.reset()  # a decoder's cache is reused across calls
    N = T  # tokens so far: out[:, :N]
    logits = _forward_window(model, out, N, starts, cache) if use_cache else None
    while True:
        if not use_cache:
            logits = _forward_window(model, out, N, starts, None)
        token = sample(logits[:, -1, :vocab_size])  # (B,)
        if finished is not None:
            token = token.masked_fill(finished, eos_id)
            finished |= token == eos_id
        out[:, N] = token
        N += 1
        if on_token is not None:
            on_token(token)
        if N == total or (finished is not None and bool(finished.all())):
            return N
        cropped = [N - keep if N - start > ctx else start for start in starts]
        if cropped != starts:  # a row's window no longer fits: it keeps its last `keep` tokens
            starts = cropped
            if use_cache:  # positions shifted: recompute the cropped window once
                cache.reset()
                logits = _forward_window(model, out, N, starts, cache)
        elif decoder is not None:
            logits = decoder.step(out[:, N - 1:N])
        elif use_cache:  # the cache continues each row's positions
            logits = model(out[:, N - 1:N], kv_cache=cache, last_only=True)


def _check_decoder(decoder, model, batch_size: int, use_cache: bool, tokens: float) -> None:
    """A decoder must be this model's, for this batch, and hold the ``tokens`` a row's window
    reaches (a ring holds any number)."""
    if decoder is None:
        return
    if not use_cache:
        raise ValueError("a static decoder decodes with its KV cache; give use_cache=True or "
                         "no decoder")
    if decoder.model is not model or decoder.batch_size != batch_size:
        raise ValueError(f"this decoder was built for another model or batch size "
                         f"({decoder.batch_size} rows, not {batch_size}); build "
                         "StaticDecoder(model, batch_size)")
    cache = decoder.cache
    if not cache.ring and cache.capacity < tokens:
        raise ValueError(f"this decoder's cache holds {cache.capacity} tokens but this "
                         f"generation reaches {tokens} (prompt + max_new_tokens); build "
                         f"StaticDecoder(model, {batch_size}, capacity={tokens})")


def _forward_window(model, out: Tensor, N: int, starts: list[int], cache):
    """Last-position logits (B, 1, V) of the model on each row's window ``out[row, start:N]``,
    left-padded to the longest window; fills ``cache`` if given."""
    first = min(starts)
    window = out[:, first:N]  # (B, L)
    if all(s == first for s in starts):
        return model(window, kv_cache=cache, last_only=True)
    cols = torch.arange(first, N, device=out.device)[None, :]  # (1, L)
    row_starts = torch.tensor(starts, device=out.device)[:, None]  # (B, 1)
    mask = cols < row_starts  # (B, L) True = outside the row's window
    position_ids = (cols - row_starts).clamp(min=0)  # (B, L)
    return model(window, key_padding_mask=mask, position_ids=position_ids, kv_cache=cache,
                 last_only=True)


def _check_generate_inputs(model, idx, max_new_tokens, key_padding_mask, vocab_size, crop_to):
    """Validate ``generate``'s arguments; return (B, T, left-padding count per row)."""
    ctx, model_vocab = model.config.context_length, model.config.vocab_size
    if not isinstance(idx, Tensor) or idx.dim() != 2 or idx.dtype != torch.long:
        got = f"{tuple(idx.shape)} {idx.dtype}" if isinstance(idx, Tensor) else type(idx).__name__
        raise ValueError(f"idx must be a (batch, tokens) long tensor, got {got}")
    B, T = idx.shape
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
    if crop_to is not None and (not isinstance(crop_to, int) or not 1 <= crop_to <= ctx):
        raise ValueError(f"crop_to={crop_to!r} must be in [1, context_length={ctx}]")
    if vocab_size is not None and not 1 <= vocab_size <= model_vocab:
        raise ValueError(f"vocab_size={vocab_size!r} must be in [1, model vocab_size="
                         f"{model_vocab}]")
    if B == 0 or T == 0:
        raise ValueError(f"generation needs at least one prompt token per row, got idx of shape "
                         f"{tuple(idx.shape)} (start from the end-of-text token)")
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= model_vocab:
        raise ValueError(f"token ids must be in [0, {model_vocab}), got ids in [{lo}, {hi}]")
    if key_padding_mask is None:
        return B, T, [0] * B
    if key_padding_mask.shape != (B, T) or key_padding_mask.dtype != torch.bool:
        raise ValueError(f"key_padding_mask must be a ({B}, {T}) bool tensor, got "
                         f"{tuple(key_padding_mask.shape)} {key_padding_mask.dtype}")
    pad_counts = key_padding_mask.sum(dim=1)
    left = torch.arange(T, device=idx.device)[None, :] < pad_counts[:, None]
    if not torch.equal(left, key_padding_mask):
        raise ValueError("key_padding_mask must mark left padding only (True before the first "
                         "real token, False after it); use pad_prompts")
    pad_counts = pad_counts.tolist()
    if max(pad_counts) == T:
        raise ValueError(f"prompt row {pad_counts.index(T)} is all padding; generation needs at "
                         "least one real token per row")
    return B, T, pad_counts
