"""The running batch over the KV cache: rows that join and leave between steps get the logits
the model gives each row's sequence alone, without a cache (the oracle: a plain forward)."""

import torch
from chat_helpers import tiny_chat_model

from minigpt.serve.batch import RunningBatch


def alone(model, ids):
    """Next-token logits (V,) after ``ids``: the uncached model on that sequence only."""
    return model(torch.tensor([ids]))[0, -1]


@torch.inference_mode()
def test_rows_joining_and_leaving_match_each_sequence_alone():
    model = tiny_chat_model(context_length=24, seed=3)
    batch = RunningBatch(model, capacity=24)
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
        logits = batch.step(torch.tensor(tokens)[:, None])
        for row, s in enumerate(seqs):
            torch.testing.assert_close(logits[row], alone(model, s), atol=1e-5, rtol=1e-5)

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
    assert len(batch) == 0 and batch.cache is None
    seqs.clear()
    join([prompt(20), prompt(2)])
    step()
    batch.keep([1])  # the longest row leaves: its padding fills the stream's start
    del seqs[0]
    for _ in range(4):  # the stream reaches the capacity: the padding is dropped
        step()
    assert batch.cache.length < 24


@torch.inference_mode()
def test_scored_prefill_gives_every_position():
    model = tiny_chat_model(context_length=24, seed=3)
    batch = RunningBatch(model, capacity=24)
    ids = [3, 1, 4, 1, 5, 9]
    logits, _ = batch.prefill([ids], all_positions=True)
    torch.testing.assert_close(logits[0], model(torch.tensor([ids]))[0], atol=1e-5, rtol=1e-5)
