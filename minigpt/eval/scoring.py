"""Log-likelihood of continuations: the one scorer behind the evaluation tasks and the harness.

A *row* (``score_rows``) is ``context + continuation``, right-padded in its batch (a causal model
never looks right), with the number of continuation tokens to score. A *group* (``score_groups``)
is one context with several continuations: the context runs once into a KV cache and each
continuation after a copy of it. Only scored positions go through the LM head.

Shape letters: R rows in a batch, G groups, T tokens, M scored tokens, C = n_embd, V vocabulary.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from minigpt.sampling import evaluating

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


def score_pairs(model, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *, batch_size: int,
                device="cpu",
                autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                progress: Callable[[int], None] | None = None,
                through_forward: bool = False) -> tuple[list[Score], list[bool]]:
    """Score each ``(context, continuation)`` pair; and whether each was cut from the left.
    Pairs with the same context run it once (``score_groups``); a pair that does not fit is cut
    (``fit_row``) and scored as a row (``score_rows``), as are all pairs of a sliding-window
    model or with ``through_forward``. ``batch_size``: continuations per batch."""
    context_length = model.config.context_length
    shared = not through_forward and getattr(model.config, "window", None) is None
    groups: dict[tuple[int, ...], list[int]] = {}
    rows, row_pairs, cut = [], [], []
    for i, (context, continuation) in enumerate(pairs):
        cut.append(len(context) + len(continuation) > context_length + 1)
        if shared and context and not cut[-1]:
            groups.setdefault(tuple(context), []).append(i)
        else:
            rows.append(fit_row(context, continuation, context_length)[:2])
            row_pairs.append(i)
    scores: list[Score | None] = [None] * len(pairs)
    options = {"batch_size": batch_size, "device": device, "autocast": autocast,
               "progress": progress}
    done = score_groups(model, [(context, [pairs[i][1] for i in members])
                                for context, members in groups.items()], **options) \
        if groups else []
    for members, group_scores in zip(groups.values(), done, strict=True):
        for i, score in zip(members, group_scores, strict=True):
            scores[i] = score
    for i, score in zip(row_pairs, score_rows(model, rows, through_forward=through_forward,
                                              **options), strict=True):
        scores[i] = score
    return scores, cut  # type: ignore[return-value]


def score_rows(model, rows: Sequence[tuple[Sequence[int], int]], *, batch_size: int, device="cpu",
               autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
               progress: Callable[[int], None] | None = None,
               through_forward: bool = False) -> list[Score]:
    """Score the last ``n`` tokens of each ``(tokens, n)`` row (``fit_row``'s output) under
    ``model`` (a ``GPT``: ``hidden_states`` and ``logits``), ``batch_size`` rows per forward pass,
    longest first (little padding), results in the order given. ``through_forward``: the logits
    from ``model(idx)`` instead, for wrappers whose weights gather only in ``forward`` (FSDP).
    ``autocast`` (e.g. ``fabric.autocast``) wraps each forward pass; log-probabilities are taken
    in float32; ``progress(k)``: after each batch of ``k`` rows. Runs in eval mode, no grad."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    scores: list[Score | None] = [None] * len(rows)
    with evaluating(model):
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            for i, score in zip(batch, _score_batch(model, [rows[i] for i in batch], device,
                                                    autocast, through_forward), strict=True):
                scores[i] = score
            if progress is not None:
                progress(len(batch))
    return scores  # type: ignore[return-value]


def score_groups(model, groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]], *,
                 batch_size: int, device="cpu",
                 autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                 progress: Callable[[int], None] | None = None) -> list[list[Score]]:
    """Score each continuation of each ``(context, continuations)`` group after its context,
    about ``batch_size`` continuations per batch: ``score_rows``' numbers, each context run once.
    Every row must fit the model (``fit_row`` cuts those that do not, for ``score_rows``) and the
    model must attend to all its context (no sliding window)."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    if getattr(model.config, "window", None) is not None:
        raise ValueError("a sliding-window model's cache keeps only its window: score its rows "
                         "whole with score_rows (score_pairs does)")
    for context, continuations in groups:
        if not context or not continuations or not all(continuations):
            raise ValueError("a group needs a context and continuations of at least one token")
        if len(context) + max(map(len, continuations)) > model.config.context_length + 1:
            raise ValueError(f"a group's rows run past context_length="
                             f"{model.config.context_length}: cut them with fit_row")
    order = sorted(range(len(groups)), key=lambda g: -len(groups[g][0]))
    scores: list[list[Score]] = [[] for _ in groups]
    start = 0
    with evaluating(model):
        while start < len(order):
            end = _batch_end(groups, order, start, batch_size, model.config.context_length)
            batch = order[start:end]
            with autocast() if autocast is not None else contextlib.nullcontext():
                done = _score_group_batch(model, [groups[g] for g in batch], device)
            for g, group_scores in zip(batch, done, strict=True):
                scores[g] = group_scores
            if progress is not None:
                progress(sum(len(groups[g][1]) for g in batch))
            start = end
    return scores


def _batch_end(groups, order: list[int], start: int, batch_size: int, context_length: int) -> int:
    """Where the batch that begins at ``order[start]`` ends: at most ``batch_size``
    continuations (at least one group), and the padded contexts (the first is the longest) plus
    the longest continuation within the model's context, as the KV cache requires."""
    end, rows, longest = start, 0, 0
    Tc = len(groups[order[start]][0])
    while end < len(order):
        context, continuations = groups[order[end]]
        longest_here = max(longest, max(map(len, continuations)))
        if end > start and (rows + len(continuations) > batch_size
                            or Tc + longest_here - 1 > context_length):
            break
        rows, longest, end = rows + len(continuations), longest_here, end + 1
    return end


def _score_group_batch(model, groups, device) -> list[list[Score]]:
    """One batch of groups: the contexts once, then all their continuations in one pass, each
    after a copy of its context's cache."""
    Te = max(len(c) for _, continuations in groups for c in continuations)
    last, cache, lengths = _run_contexts(model, [context for context, _ in groups], Te - 1,
                                          device)
    rows = [(g, c) for g, (_, continuations) in enumerate(groups) for c in continuations]
    flat = iter(_run_continuations(model, last, cache, lengths, rows, device))
    return [list(itertools.islice(flat, len(continuations))) for _, continuations in groups]


def _run_contexts(model, contexts, room: int, device):
    """The contexts left-padded (each one's last token in the last column) through the model
    into a fresh KV cache with ``room`` more tokens: the hidden state that predicts each
    continuation's first token (G, C), the cache, and the context lengths (G,)."""
    G, Tc = len(contexts), max(map(len, contexts))
    ctx = torch.tensor([[0] * (Tc - len(c)) + list(c) for c in contexts],
                       dtype=torch.long)  # (G, Tc) left-padded
    lengths = torch.tensor([len(context) for context in contexts])  # (G,)
    cols = torch.arange(Tc)[None, :]  # (1, Tc)
    padding = cols < (Tc - lengths)[:, None]  # (G, Tc) True = padding
    positions = (cols - (Tc - lengths)[:, None]).clamp(min=0)  # (G, Tc)
    cache = model.new_kv_cache(G, Tc + room, device=device)
    mask = padding.to(device) if bool(padding.any()) else None
    hidden = model.hidden_states(ctx.to(device), mask, positions.to(device), cache)  # (G, Tc, C)
    return hidden[:, -1], cache, lengths


def _run_continuations(model, last, cache, lengths, rows, device) -> list[Score]:
    """Score ``rows`` of ``(group, continuation)``: each continuation's tokens but the last run
    after a copy of its group's cache, right-padded (the first token is predicted by ``last``)."""
    Te = max(len(c) for _, c in rows)
    group = torch.tensor([g for g, _ in rows])  # (R,)
    hidden = last[group.to(device)][:, None]  # (R, 1, C) predicts each first token
    if Te > 1:
        copies = cache.rows(group.to(device))  # (R, ...) each row's context, continued its own way
        ends = pad_sequence([torch.tensor(list(c[:-1]), dtype=torch.long) for _, c in rows],
                            batch_first=True)  # (R, Te - 1) right-padded
        positions = lengths[group][:, None] + torch.arange(Te - 1)[None, :]  # (R, Te - 1)
        hidden = torch.cat([hidden, model.hidden_states(ends.to(device), None,
                                                        positions.to(device), copies)], dim=1)
    targets = pad_sequence([torch.tensor(list(c)) for _, c in rows], batch_first=True,
                           padding_value=-1)  # (R, Te) -1 = padding
    return _scores_at(model, hidden, targets.to(device), [len(c) for _, c in rows])


def _score_batch(model, rows, device, autocast, through_forward: bool) -> list[Score]:
    R, T = len(rows), max(len(tokens) for tokens, _ in rows) - 1
    idx = torch.zeros(R, T, dtype=torch.long)  # (R, T) right-padded inputs
    targets = torch.full((R, T), -1, dtype=torch.long)  # (R, T) -1 = not scored
    for r, (tokens, n) in enumerate(rows):
        if len(tokens) < 2 or not 0 < n < len(tokens):
            raise ValueError(f"row {r} has {len(tokens)} tokens and {n} to score: a row scores "
                             "1 to len - 1 tokens")
        L = len(tokens) - 1
        idx[r, :L] = torch.tensor(list(tokens[:-1]))
        targets[r, L - n:L] = torch.tensor(list(tokens[-n:]))
    idx, targets = idx.to(device), targets.to(device)
    counts = [n for _, n in rows]
    with autocast() if autocast is not None else contextlib.nullcontext():
        if through_forward:
            return _scores_at(model, None, targets, counts, logits=model(idx))
        return _scores_at(model, model.hidden_states(idx), targets, counts)


def _scores_at(model, hidden, targets, counts: list[int], logits=None) -> list[Score]:
    """The ``Score`` of each row from its hidden states (R, T, C) (or the model's ``logits``
    (R, T, V)) at the positions where ``targets`` (R, T) is not -1; ``counts``: those per row."""
    scored = targets >= 0  # (R, T)
    wanted = targets[scored]  # (M,) row by row
    if logits is not None:
        chunks = iter([logits[scored]])  # (M, V)
    else:
        hidden = hidden[scored]  # (M, C) only the positions that predict a target
        chunks = (model.logits(hidden[s:s + HEAD_CHUNK])  # (m, V)
                  for s in range(0, len(hidden), HEAD_CHUNK))
    logprobs, hits, done = [], [], 0
    for chunk in chunks:
        chunk = chunk.float()
        target = wanted[done:done + len(chunk), None]  # (m, 1)
        done += len(chunk)
        logprobs.append(F.log_softmax(chunk, dim=-1).gather(1, target)[:, 0])  # (m,)
        hits.append(chunk.argmax(dim=-1) == target[:, 0])
    R = targets.shape[0]
    row_of = scored.nonzero()[:, 0]  # (M,) each scored position's row
    sums = torch.zeros(R, dtype=torch.float64, device=targets.device)
    sums.index_add_(0, row_of, torch.cat(logprobs).double())
    misses = torch.zeros(R, dtype=torch.long, device=targets.device)
    misses.index_add_(0, row_of, (~torch.cat(hits)).long())
    return [Score(s, n, m == 0) for s, m, n in zip(sums.tolist(), misses.tolist(), counts,
                                                   strict=True)]
