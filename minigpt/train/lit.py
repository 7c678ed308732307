"""The LightningModule that trains a ``GPT``: steps, metrics, optimizer, checkpoint contents.

The math it wires together lives in ``minigpt.train.optim`` (groups, LR schedule),
``minigpt.train.device`` (peak FLOP/s) and ``minigpt.train.rng``. Shape letters: B batch,
T tokens.
"""

from __future__ import annotations

import math
import time

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from minigpt.checkpoint import checkpoint_metadata
from minigpt.model import GPT
from minigpt.train.batch import rescale_batch_progress
from minigpt.train.device import peak_flops
from minigpt.train.optim import adamw_with_schedule
from minigpt.train.rng import rng_state, set_rng_state

_COMPILED_PREFIX = "_orig_mod."


def strip_compiled_prefix(state_dict: dict) -> dict:
    """Remove ``torch.compile``'s ``_orig_mod.`` from keys, wherever it sits in the key."""
    return {k.replace(_COMPILED_PREFIX, ""): v for k, v in state_dict.items()}


class LitGPT(L.LightningModule):
    """Trains ``model`` (a ``GPT``) with AdamW, warmup + cosine LR and next-token cross-entropy.

    ``optim``: lr, min_lr, warmup_steps, decay_steps, weight_decay, beta1, beta2, eps, fused.
    ``tokenizer``: the tokenizer's ``to_dict()``, stored in every checkpoint with the model config.
    ``bytes_per_token``: UTF-8 bytes per validation token, for bits per byte (None: not logged).
    """

    def __init__(
        self,
        model: GPT,
        optim: dict,
        tokenizer: dict,
        *,
        compile: bool = False,
        bytes_per_token: float | None = None,
        peak_flops: float | None = None,
    ):
        super().__init__()
        self.model = model
        self.optim = dict(optim)
        self.tokenizer = dict(tokenizer)
        self.bytes_per_token = bytes_per_token
        self.user_peak_flops = peak_flops
        # Plain types only, so Lightning's checkpoint loads with torch.load(weights_only=True).
        self.save_hyperparameters(
            {"model": model.config.to_dict(), "optim": self.optim, "tokenizer": self.tokenizer,
             "compile": compile}
        )
        self.compiled = compile
        # The loss (forward + LM head + cross-entropy) compiled as one function; the module is
        # not wrapped, so parameter names (and checkpoints) keep no ``_orig_mod.`` prefix, and
        # sampling calls the model eagerly.
        self._loss_fn = torch.compile(model.loss) if compile else model.loss
        self._pending_rng: dict | None = None
        self._last_end = 0.0  # when the previous optimizer step ended
        self._tokens_per_s: float | None = None

    # ---- steps -------------------------------------------------------------------------------
    def _loss(self, batch) -> torch.Tensor:
        x, y = batch  # (B, T) each
        return self._loss_fn(x, y)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def on_validation_epoch_start(self):
        self._val_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._val_count = torch.zeros((), dtype=torch.float64, device=self.device)

    def validation_step(self, batch, batch_idx):
        n = batch[1].numel()
        self._val_sum += self._loss(batch).double() * n
        self._val_count += n

    def on_validation_epoch_end(self):
        # Token-weighted mean over all ranks' windows: the same number for any device count.
        total = self.trainer.strategy.reduce(self._val_sum, reduce_op="sum")
        count = self.trainer.strategy.reduce(self._val_count, reduce_op="sum")
        loss = float(total / count.clamp(min=1))
        self.log("val/loss", loss, prog_bar=True)
        metrics = {"val/ppl": math.exp(min(loss, 50.0))}
        if self.bytes_per_token:
            metrics["val/bpb"] = loss / math.log(2) / self.bytes_per_token
        self.log_dict(metrics)

    # ---- throughput, tokens, gradient norm ---------------------------------------------------
    def _tokens_per_step(self) -> int:
        return self._tokens_per_batch * self.trainer.accumulate_grad_batches * self.trainer.world_size

    def on_train_start(self):
        self._last_end = time.perf_counter()

    def on_validation_end(self):
        # Validation, samples and checkpoints are not training throughput: restart the clock.
        self._last_end = time.perf_counter()

    def on_train_batch_start(self, batch, batch_idx):
        if self._pending_rng is not None:
            # Restored here, not in on_load_checkpoint: creating the dataloader iterator after
            # the restore draws from torch's RNG, which the uninterrupted run did long ago.
            set_rng_state(self._pending_rng)
            self._pending_rng = None
        self._tokens_per_batch = batch[0].numel()
        # The lr this step uses: by on_train_batch_end the scheduler has already moved on.
        self._lr = self.trainer.optimizers[0].param_groups[0]["lr"]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if (batch_idx + 1) % self.trainer.accumulate_grad_batches:
            return  # mid-accumulation: the optimizer has not stepped yet
        now = time.perf_counter()
        rate = self._tokens_per_step() / max(now - self._last_end, 1e-9)  # incl. data loading
        self._last_end = now
        # Exponential moving average: one step's timing on a shared machine is noisy.
        ema = self._tokens_per_s
        self._tokens_per_s = rate if ema is None else 0.9 * ema + 0.1 * rate
        tokens_seen = float(self.trainer.global_step * self._tokens_per_step())
        metrics = {"tokens": tokens_seen, "tokens_per_s": self._tokens_per_s, "lr": self._lr}
        peak = self.user_peak_flops or peak_flops(self.device)
        if peak:
            flops = self.model.flops_per_token(batch[0].shape[1]) * self._tokens_per_s
            metrics["mfu"] = flops / (peak * self.trainer.world_size)
        self.log_dict(metrics, on_step=True, on_epoch=False)

    def on_before_optimizer_step(self, optimizer):
        # Clipping here rather than with Trainer(gradient_clip_val=...): Lightning refuses that
        # for fused optimizers under mixed precision. Grads are already unscaled under fp16
        # (fused is off there). The logged norm is the one before clipping.
        max_norm = self.optim.get("grad_clip") or float("inf")
        module = self.trainer.strategy.model
        if hasattr(module, "clip_grad_norm_"):  # FSDP: the norm over all shards
            norm = module.clip_grad_norm_(max_norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)
        self.log("grad_norm", norm, on_step=True, on_epoch=False)

    # ---- optimizer ---------------------------------------------------------------------------
    def configure_optimizers(self):
        # The fused kernel steps all parameters of a group at once; it needs floating-point
        # parameters on a device type that implements it. Not under fp16: there the grad scaler
        # must unscale before clipping, which Lightning skips for optimizers that unscale
        # internally.
        device_type = next(self.model.parameters()).device.type
        fp16 = str(self.trainer.precision).startswith("16")
        fused = self.optim.get("fused", True) and device_type in ("cuda", "cpu", "xpu", "mps") \
            and not fp16
        optimizer, scheduler = adamw_with_schedule(self.model, self.optim, fused=fused)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

    # ---- checkpoints -------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["state_dict"] = strip_compiled_prefix(checkpoint["state_dict"])
        checkpoint["minigpt"] = checkpoint_metadata(self.model.config.to_dict(), self.tokenizer)
        states = rng_state()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, states)
            checkpoint["rng_states"] = gathered
        else:
            checkpoint["rng_states"] = [states]

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # Checkpoints written by a module compiled with torch.compile(...) still load. (A
        # sharded FSDP checkpoint arrives here without its tensors: FSDP loaded them already.)
        if "state_dict" in checkpoint:
            checkpoint["state_dict"] = strip_compiled_prefix(checkpoint["state_dict"])
        # Written by another number of processes: the same tokens per step may now take another
        # number of micro-batches, and Lightning counts micro-batches.
        accumulate = self.trainer.accumulate_grad_batches if self._trainer is not None else 1
        if rescale_batch_progress(checkpoint.get("loops") or {}, checkpoint.get("global_step", 0),
                                  accumulate):
            rank_zero_info(f"resuming at step {checkpoint['global_step']} with {accumulate} "
                           "micro-batch(es) per step, another accumulation than the checkpoint's")
        states = checkpoint.get("rng_states")
        # A rank the checkpoint had no process for keeps its fresh per-rank seed.
        if states and self.global_rank < len(states):
            self._pending_rng = states[self.global_rank]
