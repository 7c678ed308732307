"""Lightning glue that is not the model's business: atomic checkpoint files, ``last`` linked to
``best`` when they hold the same state, a checkpoint on Ctrl-C / SIGTERM, a consolidated model
file after sharded FSDP training, a text sample at each validation, a progress bar counted in
steps."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn

from minigpt.files import atomic_write
from minigpt.sampling import generate


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes a temporary file next to the target, fsyncs, then renames it into place.

    Lightning's own writer goes through an fsspec transaction whose temporary file lives in the
    system temp dir; when that is another filesystem the final move is a copy into the target, so
    a crash mid-copy leaves a truncated ``last.ckpt``. A rename within one directory cannot."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: torch.save(checkpoint, tmp))


def unlink_if_link(trainer, path) -> None:
    """Remove ``path`` if it is a symbolic link (``last`` pointing at ``best``), so that a
    checkpoint written there replaces the link rather than going into ``best``. Collective."""
    if trainer.is_global_zero and os.path.islink(path):
        os.remove(path)
    trainer.strategy.barrier()


class LinkingModelCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (``best`` by val/loss, and ``last``) writing each state
    once: when validation improved, ``last`` becomes a link to the ``best`` just written rather
    than a second copy (GPT-2 small's weights and Adam state are 1.5 GB; under FSDP a directory of
    shards); otherwise ``last`` is written itself, replacing any old link.

    Lightning's own ``save_last="link"`` links to the newest top-k file even when this step wrote
    none, which would leave ``last`` on an older state."""

    def _save_last_checkpoint(self, trainer, monitor_candidates) -> None:
        if not self.save_last:
            return
        best_is_now = bool(self._last_checkpoint_saved) and \
            self._last_global_step_saved == trainer.global_step
        if not best_is_now:
            unlink_if_link(trainer, self.format_checkpoint_name(monitor_candidates,
                                                                self.CHECKPOINT_NAME_LAST))
        self.save_last = "link" if best_is_now else True
        super()._save_last_checkpoint(trainer, monitor_candidates)


class ModelFileAtEnd(L.Callback):
    """After training with sharded FSDP checkpoints: ``last.ckpt`` (a directory of shards) at the
    final step, and its model-only ``model.ckpt`` consolidated by rank 0 for ``generate.py``."""

    def __init__(self, ckpt_dir: str | Path):
        self.ckpt_dir = Path(ckpt_dir)

    def on_train_end(self, trainer, pl_module):
        from minigpt.consolidate import METADATA_FILE, consolidate

        last = self.ckpt_dir / "last.ckpt"
        saved_step = None
        if trainer.is_global_zero and (last / METADATA_FILE).is_file():
            saved_step = torch.load(last / METADATA_FILE, weights_only=True).get("global_step")
        if trainer.strategy.broadcast(saved_step) != trainer.global_step:
            unlink_if_link(trainer, last)
            trainer.save_checkpoint(last)
        if trainer.is_global_zero:
            rank_zero_info(f"consolidated the model into {consolidate(last)}")
        trainer.strategy.barrier()


class CheckpointOnInterrupt(L.Callback):
    """SIGTERM (what schedulers send) or a first Ctrl-C: finish the current step, save
    ``last.ckpt``, exit. A second Ctrl-C aborts at once.

    SIGTERM is Lightning's own handling (``trainer.received_sigterm``: all ranks stop at the same
    step boundary and raise ``SIGTERMException``); Ctrl-C is routed into it by re-sending SIGTERM
    to this process, so both leave a consistent checkpoint. Other exceptions (crashes) save
    nothing, so a bad state never replaces the last good checkpoint."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.signal_name: str | None = None
        self._previous_sigint = None

    def on_train_start(self, trainer, pl_module):
        try:
            self._previous_sigint = signal.signal(signal.SIGINT, self._on_sigint)
        except ValueError:  # not the main thread (e.g. a notebook worker): keep the default
            self._previous_sigint = None

    def _on_sigint(self, signum, frame):
        self.signal_name = "Ctrl-C"
        rank_zero_info("\nCtrl-C: saving a checkpoint after this step (Ctrl-C again to abort)")
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.kill(os.getpid(), signal.SIGTERM)

    def _restore(self):
        if self._previous_sigint is not None:
            signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None

    def on_train_end(self, trainer, pl_module):
        self._restore()

    def on_exception(self, trainer, pl_module, exception):
        self._restore()
        if not isinstance(exception, SIGTERMException) or trainer.sanity_checking:
            return
        self.signal_name = self.signal_name or "SIGTERM"
        if trainer.global_step == 0:
            rank_zero_info(f"{self.signal_name} before the first step: no checkpoint written")
            return
        unlink_if_link(trainer, self.path)
        trainer.save_checkpoint(self.path)
        rank_zero_info(f"{self.signal_name}: saved {self.path} at step {trainer.global_step}; "
                       f"resume with `python train.py ckpt_path={self.path}`")


@contextlib.contextmanager
def gathered_parameters(wrapped: nn.Module | None, recurse: bool = False):
    """Full parameters of an FSDP-wrapped model while in this context; anything else as it is.

    Code that calls the model outside the wrapped forward (sampling, a checksum) would see the
    sharded root-level parameters (embeddings, final LayerNorm) of FSDP's root unit. With
    ``recurse=False`` only those are gathered: each Block unit gathers its own in its forward.
    A collective: every rank must enter it."""
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FullyShardedDataParallel

        if isinstance(wrapped, FullyShardedDataParallel):
            with FullyShardedDataParallel.summon_full_params(wrapped, writeback=False,
                                                             recurse=recurse):
                yield
            return
    yield


class SampleText(L.Callback):
    """Generates a short sample from ``prompt`` after each validation, prints it, appends it to
    ``samples.txt`` and logs it (a growing table on wandb, text on other loggers).

    Runs on every rank with the same seed (sharded models need all ranks in the forward pass),
    with its own generator so the training RNG streams are untouched, and inside the precision
    plugin's forward context (autocast under mixed precision) like the training and validation
    steps: under FSDP the gathered root parameters are float32 while the blocks unshard in bf16."""

    def __init__(self, tokenizer, path: str | Path, prompt: str = "\n", max_new_tokens: int = 200,
                 temperature: float = 0.8, top_k: int | None = None, seed: int = 0):
        self.tokenizer, self.path = tokenizer, Path(path)
        self.prompt, self.max_new_tokens = prompt, max_new_tokens
        self.temperature, self.top_k, self.seed = temperature, top_k, seed
        self.rows: list[list] = []
        self._failed = False

    def _prompt_ids(self) -> list[int]:
        ids = self.tokenizer.encode(self.prompt) if self.prompt else []
        return ids or [self.tokenizer.eot_id]

    def on_validation_end(self, trainer, pl_module):
        if trainer.sanity_checking or self._failed or self.max_new_tokens <= 0:
            return
        model = pl_module.model
        was_training = model.training
        model.eval()
        try:
            generator = torch.Generator(device=pl_module.device).manual_seed(self.seed)
            idx = torch.tensor([self._prompt_ids()], device=pl_module.device)  # (1, T)
            idx = idx[:, -model.config.context_length:]
            with gathered_parameters(getattr(trainer.strategy, "model", None)), \
                    trainer.precision_plugin.forward_context():
                out = generate(model, idx, self.max_new_tokens, temperature=self.temperature,
                               top_k=self.top_k, generator=generator,
                               vocab_size=self.tokenizer.vocab_size)
            text = self.tokenizer.decode(out[0].tolist())
        except Exception as e:  # a sample is a nicety: never let it stop training
            self._failed = True
            rank_zero_warn(f"sampling failed, samples are off for this run: {type(e).__name__}: {e}")
            return
        finally:
            model.train(was_training)
        if not trainer.is_global_zero:
            return
        step = trainer.global_step
        rank_zero_info(f"\n--- sample at step {step} ---\n{text}\n---")
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(f"--- step {step} ---\n{text}\n")
        self.rows.append([step, text])
        for logger in trainer.loggers:
            if hasattr(logger, "log_table"):  # WandbLogger
                logger.log_table(key="samples", columns=["step", "text"], data=self.rows, step=step)
            elif hasattr(logger, "log_text"):
                logger.log_text(key="samples", columns=["step", "text"], data=[[step, text]],
                                step=step)


class StepProgressBar(TQDMProgressBar):
    """Lightning's bar, labelled by step: "epochs" of an endless stream mean nothing.

    On a GPU it refreshes every ``log_every_n_steps`` optimizer steps, not every micro-batch:
    each refresh reads ``train/loss`` back from the device, a sync that stalls the queue of
    kernels the CPU has run ahead with."""

    def setup(self, trainer, pl_module, stage):
        super().setup(trainer, pl_module, stage)
        if trainer.strategy.root_device.type == "cuda":
            self._refresh_rate = refresh_batches(trainer.log_every_n_steps,
                                                 trainer.accumulate_grad_batches)

    def on_train_epoch_start(self, trainer, *args):
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description("train")


def refresh_batches(log_every_n_steps: int, accumulate: int) -> int:
    """Micro-batches between progress-bar refreshes on a GPU: one per logging interval."""
    return max(1, log_every_n_steps) * accumulate
