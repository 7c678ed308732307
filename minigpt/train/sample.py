"""A short text sample after each validation: printed, appended to ``samples.txt``, logged."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from lightning.fabric.utilities import rank_zero_warn
from torch import nn

from minigpt.files import atomic_write
from minigpt.sampling import generate

if TYPE_CHECKING:
    from minigpt.config import SampleSchema


@contextlib.contextmanager
def gathered_parameters(wrapped: nn.Module | None, recurse: bool = False):
    """Full parameters of an FSDP-wrapped model inside this context (a collective: every rank
    enters it), for calls outside the wrapped forward; anything else as it is. ``recurse=False``
    gathers the root unit's only (each Block unit gathers its own in its forward)."""
    if wrapped is not None and torch.distributed.is_available():  # builds without it exist
        from torch.distributed.fsdp import FullyShardedDataParallel

        root = next((m for m in wrapped.modules() if isinstance(m, FullyShardedDataParallel)), None)
        if root is not None:
            with FullyShardedDataParallel.summon_full_params(root, writeback=False,
                                                             recurse=recurse):
                yield
            return
    yield


class Sampler:
    """Generates from ``sample.prompt`` with its own seeded generator (the training RNG streams
    are untouched), on every rank (sharded models need all ranks in the forward pass)."""

    def __init__(self, tokenizer, path: str | Path, sample_cfg: SampleSchema, seed: int):
        self.tokenizer, self.path, self.cfg, self.seed = tokenizer, Path(path), sample_cfg, seed
        self.rows: list[list] = []  # (step, text) so far, for the loggers' tables
        self.failed = False

    def _prompt_ids(self) -> list[int]:
        prompt = self.cfg.prompt
        return (self.tokenizer.encode(prompt) if prompt else []) or [self.tokenizer.eot_id]

    def sample(self, model, device: torch.device, autocast,
               wrapped: nn.Module | None) -> str | None:
        """The sample text, or None when samples are off (``sample.max_new_tokens=0``) or failed
        before (a sample is a nicety: it never stops training)."""
        if self.failed or self.cfg.max_new_tokens <= 0:
            return None
        was_training = model.training
        model.eval()
        try:
            generator = torch.Generator(device=device).manual_seed(self.seed)
            prompt = self._prompt_ids()[-model.config.context_length:]
            idx = torch.tensor([prompt], device=device)  # (1, T)
            with gathered_parameters(wrapped), autocast:
                out = generate(model, idx, self.cfg.max_new_tokens,
                               temperature=self.cfg.temperature, top_k=self.cfg.top_k,
                               generator=generator, vocab_size=self.tokenizer.vocab_size)
            return self.tokenizer.decode(out[0].tolist())
        except Exception as e:
            self.failed = True
            rank_zero_warn(f"sampling failed, samples are off for this run: "
                           f"{type(e).__name__}: {e}")
            return None
        finally:
            model.train(was_training)

    def record(self, step: int, text: str) -> None:
        """Append to ``samples.txt`` (rank 0 calls this), rewritten whole through
        ``atomic_write``: a full disk is one line and keeps the samples so far."""
        earlier = self.path.read_bytes() if self.path.exists() else b""
        added = f"--- step {step} ---\n{text}\n".encode()
        atomic_write(self.path, lambda tmp: tmp.write_bytes(earlier + added))
        self.rows.append([step, text])
