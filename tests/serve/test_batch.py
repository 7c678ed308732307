"""The running batch over the KV cache: rows that join and leave between steps get the logits
the model gives each row's sequence alone, without a cache (the oracle: a plain forward)."""

import random

import pytest
import torch
from chat_helpers import tiny_chat_model

from minigpt.serve.batch import RunningBatch
from minigpt.serve.graphs import bucket_sizes


def alone(model, ids):
    """Next-token logits (V,) after ``ids``: the uncached model on that sequence only."""
    return model(torch.tensor([ids], device=model.tok_emb.weight.device))[0, -1]


CUDA_GRAPHS = pytest.param("cuda-graphs", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a GPU"))


@pytest.mark.parametrize("fixed", [None, "eager", CUDA_GRAPHS])
@torch.inference_mode()
def test_rows_joining_and_leaving_match_each_sequence_alone(fixed):
    """``fixed``: the steps run on ``FixedShapeSteps`` over the cache's own buffers, replayed
    from CUDA graphs or run eagerly, with 4 rows at most (a 5th row's steps run sliced) and
    views of 8, 16 and 24 slots."""
    model = tiny_chat_model(context_length=24, seed=3)
    if fixed == "cuda-graphs":
        model.cuda()
    batch = RunningBatch(model, capacity=24, max_rows=5, graph_rows=0 if fixed is None else 4,
                         capture=fixed == "cuda-graphs", slot_bucket=8)
    # what a slot never written holds must never be read (sliced steps), or weigh nothing
    # (fixed shapes weigh every slot of a view, masked ones by 0: finite, then)
    for buffer in batch.cache.full.keys + batch.cache.full.values:
        buffer.fill_(float("nan") if fixed is None else 1e4)
    batch.cache.full.next_position.fill_(23)  # and a spare row must not run past the context
    if fixed:  # the fixed shapes hold no copy of the cache
        for theirs, ours in zip(batch.fixed_steps.cache.keys, batch.cache.full.keys, strict=True):
            assert theirs.data_ptr() == ours.data_ptr() and theirs.shape[0] == 4
    g = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(0, 40, (n,), generator=g).tolist()  # noqa: E731
    seqs = []  # each row's tokens so far, in batch order

    def join(prompts):
        logits, cache = batch.prefill(prompts)
        for row, p in enumerate(prompts):
            torch.testing.assert_close(logits[row], alone(model, p), atol=1e-5, rtol=1e-5)
        batch.join(cache, list(range(len(seqs), len(seqs) + len(prompts))))
        seqs.extend(list(p) for p in prompts)

    def step():
        tokens = [int(torch.randint(0, 40, (1,), generator=g)) for _ in seqs]
        for s, t in zip(seqs, tokens, strict=True):
            s.append(t)
        logits = batch.step(torch.tensor(tokens, device=model.tok_emb.weight.device)[:, None])
        if fixed:  # the fixed-shape copy took the step, unless the rows outnumber it
            assert batch._in_fixed == (len(seqs) <= 4)
        tolerance = 1e-4 if fixed else 1e-5  # a masked sum over every slot rounds differently
        for row, s in enumerate(seqs):
            torch.testing.assert_close(logits[row], alone(model, s), atol=tolerance,
                                       rtol=tolerance)

    join([prompt(5)])
    step()
    join([prompt(9), prompt(2)])  # longer than the running row: all end together
    for _ in range(3):
        step()
    batch.keep([1, 2])  # the first row leaves
    del seqs[0]
    step()
    join([prompt(3)])
    for _ in range(10):  # the stream reaches the capacity: padding dropped, rows go on
        step()
    assert max(map(len, seqs)) <= 24
    batch.keep([])
    assert len(batch) == 0 and len(batch.cache.padding) == 0
    seqs.clear()
    join([prompt(20), prompt(2)])
    step()
    batch.keep([1])  # the longest row leaves: its padding fills the stream's start
    del seqs[0]
    for _ in range(4):  # the stream reaches the capacity: the padding is dropped
        step()
    assert batch.cache.length < 24
    join([prompt(2), prompt(3), prompt(4), prompt(5)])  # 5 rows: more than the fixed steps hold
    for _ in range(2):
        step()
    batch.keep([0, 1, 2])
    del seqs[3:]
    step()


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(16) == [1, 2, 4, 8, 16]
    assert bucket_sizes(12) == [1, 2, 4, 8, 12]


@torch.inference_mode()
def test_scored_prefill_gives_every_position():
    model = tiny_chat_model(context_length=24, seed=3)
    batch = RunningBatch(model, capacity=24, max_rows=1)
    ids = [3, 1, 4, 1, 5, 9]
    logits, _ = batch.prefill([ids], all_positions=True)
    torch.testing.assert_close(logits[0], model(torch.tensor([ids]))[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed,graph_rows", [(0, 0), (1, 0), (2, 0), (3, 0), (0, 4), (1, 4)])
@torch.inference_mode()
def test_random_joins_leaves_and_steps_match_each_sequence_alone(seed, graph_rows):
    """Random walks of joins (prompts of 1-3 or 10-12 tokens: the running rows' tokens move
    either way, by more than they hold), leaves and steps over buffers that start as NaN (as
    garbage, under fixed-shape steps of up to ``graph_rows`` rows, run eagerly): every step's
    logits equal each row's sequence run alone."""
    model = tiny_chat_model(context_length=32, seed=3)
    rnd = random.Random(seed)
    for _ in range(40):
        batch = RunningBatch(model, capacity=32, max_rows=6, graph_rows=graph_rows,
                             slot_bucket=8)
        for buffer in batch.cache.full.keys + batch.cache.full.values:
            buffer.fill_(1e4 if graph_rows else float("nan"))
        batch.cache.full.next_position.fill_(31)
        seqs = []
        for _ in range(30):
            longest = max(map(len, seqs), default=0)
            choice = rnd.random()
            if choice < 0.3 and len(seqs) < 6:
                prompts = [[rnd.randrange(40) for _ in range(rnd.choice((1, 2, 3, 10, 12)))]
                           for _ in range(rnd.randint(1, 6 - len(seqs)))]
                if max(map(len, prompts)) + longest > 31:
                    continue
                _, cache = batch.prefill(prompts)
                batch.join(cache, prompts)
                seqs += prompts
            elif choice < 0.45 or longest >= 31:
                kept = sorted(rnd.sample(range(len(seqs)), rnd.randint(0, len(seqs))))
                batch.keep(kept)
                seqs = [seqs[r] for r in kept]
            elif seqs:
                tokens = [rnd.randrange(40) for _ in seqs]
                logits = batch.step(torch.tensor(tokens)[:, None])
                for row, (s, t) in enumerate(zip(seqs, tokens, strict=True)):
                    s.append(t)
                    torch.testing.assert_close(logits[row], alone(model, s), atol=1e-4,
                                               rtol=1e-4)
