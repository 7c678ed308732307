"""The document rungs' quality table: every run scored on the same held-out documents, each
document alone.

    python train.py -m experiment=document_lab threads=1 trainer.enable_progress_bar=false
    python -m bench.recipe_documents outputs/document_lab/<time> --data data/shakespeare_paragraphs

Per run: its logged val/loss (the training run's own validation rows: windows cut anywhere in
the val stream for align=window, BOS-aligned rows for align=bos, each document masked off from
the others with the document mask) and the documents' loss: every held-out document of the val
split run alone from its start (positions from 0, after the end-of-text token that precedes it,
cropped to the model's context), the token-weighted mean cross-entropy of predicting its tokens
and the end-of-text that closes it. Run alone, a document is what every variant can be scored
on alike: no variant sees another document's tokens, none is cut mid-document.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from bench import runs as lab
from minigpt.checkpoint import load_checkpoint
from minigpt.data.bos import document_starts
from minigpt.data.tokens import load_meta, open_tokens

IGNORE = -100


def held_out_documents(prepared: Path, context_length: int) -> list[np.ndarray]:
    """Each val document as its tokens plus the next end-of-text (the targets' last), after
    the end-of-text before it (the first document has none), at most ``context_length + 1``."""
    meta = load_meta(prepared)
    tokens = np.asarray(open_tokens(prepared, "val", meta)).astype(np.int64)
    # the first document has no end-of-text before it: it starts at 0
    starts = np.union1d([0], document_starts(tokens, meta["tokenizer"]["eot_id"]))
    ends = np.append(starts[1:] + 1, len(tokens))
    return [tokens[a:min(b, a + context_length + 1)] for a, b in zip(starts, ends, strict=True)
            if b - a > 1]


@torch.no_grad()
def document_loss(model, documents: list[np.ndarray], batch_tokens: int = 2048) -> float:
    """Token-weighted mean next-token loss of ``documents``, each alone (right-padded in
    batches of similar lengths, about ``batch_tokens`` padded tokens each: causal attention, so
    padding after a document changes nothing before it; padded targets are ignored)."""
    order = sorted(range(len(documents)), key=lambda i: len(documents[i]))
    total, count = 0.0, 0
    for batch in _batches([documents[i] for i in order], batch_tokens):
        width = max(len(d) for d in batch) - 1
        idx = torch.zeros(len(batch), width, dtype=torch.long)
        targets = torch.full((len(batch), width), IGNORE, dtype=torch.long)
        for row, document in enumerate(batch):
            idx[row, :len(document) - 1] = torch.from_numpy(document[:-1])
            targets[row, :len(document) - 1] = torch.from_numpy(document[1:])
        n = int((targets != IGNORE).sum())
        total += float(model.loss(idx, targets, ignore_index=IGNORE)) * n
        count += n
    return total / count


def _batches(documents: list[np.ndarray], batch_tokens: int):
    """Consecutive runs of ``documents`` (sorted by length) of at most ``batch_tokens`` padded
    tokens (at least one document each)."""
    batch = []
    for document in documents:
        if batch and (len(batch) + 1) * (len(document) - 1) > batch_tokens:
            yield batch
            batch = []
        batch.append(document)
    if batch:
        yield batch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    lab.add_run_arguments(parser, out="unused.png")
    parser.add_argument("--data", type=Path, default=Path("data/shakespeare_paragraphs"),
                        help="the prepared dataset the runs trained on")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--every", type=int, default=1,
                        help="score every n-th held-out document (1: all)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("| run | steps | logged val/loss | held-out documents' loss |")
    print("|---|---:|---:|---:|")
    documents = None
    for run_dir, name in lab.labelled_runs(parser, args.run_dirs, args.labels):
        model, _, _ = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
        if documents is None:
            documents = held_out_documents(args.data, model.config.context_length)[::args.every]
        result = lab.summary(run_dir)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # as the runs validated
            loss = document_loss(model.eval(), documents)
        print(f"| {name} | {result['steps']} | {lab.cell(result.get('val_loss'), '.4f')} | "
              f"{loss:.4f} |", flush=True)
    print(f"\n{len(documents):,} held-out documents, "
          f"{sum(len(d) - 1 for d in documents):,} scored tokens")


if __name__ == "__main__":
    main()
