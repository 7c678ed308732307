"""Log-likelihood of continuations: the one scorer behind HellaSwag and the harness model.

A *row* is a token list ``context + continuation`` with the number of continuation tokens to
score. Rows of one batch are right-padded: a causal model never looks right, so padding after a
row's last token changes none of its logits, and no attention mask is needed. Only the scored
positions go through the LM head (the head is a large share of a small model's work).

Shape letters: R rows in a batch, T tokens, M scored tokens, C = n_embd, V vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

HEAD_CHUNK = 4096  # scored positions per LM-head call: bounds the (M, V) float32 logits


@dataclass(frozen=True)
class Score:
    """A continuation's summed log-probability, its token count, and whether greedy decoding
    (argmax at every position) would have produced it."""

    logprob: float
    tokens: int
    greedy: bool


def fit_row(context: Sequence[int], continuation: Sequence[int],
            context_length: int) -> tuple[list[int], int, bool]:
    """``(tokens, n_scored, cut)``: ``context + continuation`` cut from the left to the
    ``context_length + 1`` tokens one forward pass scores (the model reads all but the last),
    the continuation tokens left to score, and whether anything was cut."""
    row = list(context) + list(continuation)
    cut = len(row) > context_length + 1
    row = row[-(context_length + 1):]
    return row, min(len(continuation), len(row) - 1), cut


def score_rows(model, rows: Sequence[tuple[Sequence[int], int]], *, batch_size: int,
               device="cpu", autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
               progress: Callable[[int], None] | None = None) -> list[Score]:
    """Score the last ``n`` tokens of each ``(tokens, n)`` row (``fit_row``'s output) under
    ``model`` (a ``GPT``: ``hidden_states`` and ``lm_head``), ``batch_size`` rows per forward pass.

    Rows run longest first, so a batch holds rows of similar length and little padding; results
    come back in the order given. ``autocast`` (e.g. ``fabric.autocast``) wraps each forward pass;
    log-probabilities are taken in float32. ``progress(k)`` is called after each batch of ``k``
    rows. The model runs in eval mode without gradients; its training flag is restored.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    scores: list[Score | None] = [None] * len(rows)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                batch = order[start:start + batch_size]
                for i, score in zip(batch, _score_batch(model, [rows[i] for i in batch], device,
                                                        autocast), strict=True):
                    scores[i] = score
                if progress is not None:
                    progress(len(batch))
    finally:
        model.train(was_training)
    return scores  # type: ignore[return-value]


def _score_batch(model, rows, device, autocast) -> list[Score]:
    R, T = len(rows), max(len(tokens) for tokens, _ in rows) - 1
    idx = torch.zeros(R, T, dtype=torch.long)  # (R, T) right-padded inputs
    targets = torch.full((R, T), -1, dtype=torch.long)  # (R, T) -1 = not scored
    for r, (tokens, n) in enumerate(rows):
        if len(tokens) < 2 or not 0 < n < len(tokens):
            raise ValueError(f"row {r} has {len(tokens)} tokens and {n} to score: a row scores "
                             "1 to len - 1 tokens")
        L = len(tokens) - 1
        idx[r, :L] = torch.tensor(tokens[:-1])
        targets[r, L - n:L] = torch.tensor(tokens[-n:])
    idx, targets = idx.to(device), targets.to(device)
    scored = targets >= 0  # (R, T)
    with autocast() if autocast is not None else contextlib.nullcontext():
        hidden = model.hidden_states(idx)[scored]  # (M, C) the positions that predict a target
        wanted = targets[scored]  # (M,)
        logprobs, hits = [], []
        for s in range(0, len(wanted), HEAD_CHUNK):
            logits = model.lm_head(hidden[s:s + HEAD_CHUNK]).float()  # (m, V)
            logp = F.log_softmax(logits, dim=-1)
            target = wanted[s:s + HEAD_CHUNK, None]  # (m, 1)
            logprobs.append(logp.gather(1, target)[:, 0])
            hits.append(logits.argmax(dim=-1) == target[:, 0])
    row_of = scored.nonzero()[:, 0]  # (M,) each scored position's row
    sums = torch.zeros(R, dtype=torch.float64, device=idx.device)
    sums.index_add_(0, row_of, torch.cat(logprobs).double())
    misses = torch.zeros(R, dtype=torch.long, device=idx.device)
    misses.index_add_(0, row_of, (~torch.cat(hits)).long())
    return [Score(s, n, m == 0) for s, m, (_, n) in zip(sums.tolist(), misses.tolist(), rows,
                                                        strict=True)]
