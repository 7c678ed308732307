"""The LightningModule that trains a ``GPT``: steps, metrics, optimizer groups, LR schedule.

Pure helpers (``lr_at``, ``param_groups``, ``default_precision``, ``peak_flops``) are plain
functions with tests. Shape letters: B batch, T tokens, V vocabulary (padded).
"""

from __future__ import annotations

import math
import random
import time
from functools import partial

import lightning as L
import numpy as np
import torch
from torch import nn

from minigpt.checkpoint import checkpoint_metadata
from minigpt.model import GPT

_COMPILED_PREFIX = "_orig_mod."

# Dense bf16/fp16 tensor-core peaks (FLOP/s) of common GPUs, matched by substring of the device
# name, most specific first. MFU is only reported when the device is found here (or the user
# sets ``peak_flops``), since a wrong peak is worse than none.
GPU_PEAK_FLOPS = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("A6000", 155e12),
    ("V100", 125e12),
    ("T4", 65e12),
)


def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """Learning rate after ``step`` optimizer steps: linear warmup from lr/warmup_steps to ``lr``
    over ``warmup_steps``, cosine decay to ``min_lr`` at ``decay_steps``, then ``min_lr``."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)  # in [0, 1)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on the weight matrices of ``nn.Linear`` layers only; biases,
    LayerNorm and embeddings (including the LM head tied to the token embedding) get none.

    Decided by module type, not ``p.dim()``, so it also holds for FSDP's flattened shards."""
    embedding_ids = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    decay_ids = {
        id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)
    } - embedding_ids
    decay, no_decay = [], []
    for p in model.parameters():  # yields a tied tensor once
        if p.requires_grad:
            (decay if id(p) in decay_ids else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
        if "amx_bf16" in flags or "avx512_bf16" in flags:
            return True
    except OSError:
        pass
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool((check and check()) or (amx and amx()))


def default_precision(accelerator: str) -> str:
    """Lightning precision for a device: ``bf16-mixed`` where the hardware multiplies bf16
    natively (CUDA with bf16 support; CPUs with AMX or AVX512-BF16), ``16-mixed`` (with a grad
    scaler) on older GPUs, ``32-true`` elsewhere."""
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    if accelerator in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            return "32-true"
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    if accelerator == "cpu":
        return "bf16-mixed" if _cpu_has_native_bf16() else "32-true"
    return "32-true"


def peak_flops(device: torch.device) -> float | None:
    """Dense half-precision peak of a known GPU, else None (MFU is then not logged)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in GPU_PEAK_FLOPS if key in name), None)


def strip_compiled_prefix(state_dict: dict) -> dict:
    """Remove ``torch.compile``'s ``_orig_mod.`` from keys, wherever it sits in the key."""
    return {k.replace(_COMPILED_PREFIX, ""): v for k, v in state_dict.items()}


def _rng_state() -> dict:
    """Python, NumPy and torch RNG states as weights_only-safe types (tensors, ints, tuples)."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (np_name, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss,
                  np_gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(tuple(v if not isinstance(v, list) else tuple(v) for v in state["python"]))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state((np_name, np_keys.numpy().astype(np.uint32), np_pos, np_has_gauss,
                         np_gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
            _set_rng_state(self._pending_rng)
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
        o = self.optim
        groups = param_groups(self.model, o["weight_decay"])
        # The fused kernel steps all parameters of a group at once (~5x on a CPU for GPT-2
        # small); it needs floating-point parameters on a device type that implements it.
        # Not under fp16: there the grad scaler must unscale before clipping, which Lightning
        # skips for optimizers that unscale internally.
        device_type = next(self.model.parameters()).device.type
        fp16 = str(self.trainer.precision).startswith("16")
        fused = o.get("fused", True) and device_type in ("cuda", "cpu", "xpu", "mps") and not fp16
        optimizer = torch.optim.AdamW(
            groups, lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"],
            **({"fused": True} if fused else {}),
        )
        # The lambda is a partial, so its arguments (not a closure) are inspectable; the step
        # count lives in the scheduler's state and comes back on resume.
        schedule = partial(
            _lr_ratio, lr=o["lr"], min_lr=o["min_lr"], warmup_steps=o["warmup_steps"],
            decay_steps=o["decay_steps"],
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

    # ---- checkpoints -------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["state_dict"] = strip_compiled_prefix(checkpoint["state_dict"])
        checkpoint["minigpt"] = checkpoint_metadata(self.model.config.to_dict(), self.tokenizer)
        states = _rng_state()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, states)
            checkpoint["rng_states"] = gathered
        else:
            checkpoint["rng_states"] = [states]

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # Checkpoints written by a module compiled with torch.compile(...) still load.
        checkpoint["state_dict"] = strip_compiled_prefix(checkpoint["state_dict"])
        states = checkpoint.get("rng_states")
        if states:
            rank = self.global_rank if len(states) > self.global_rank else 0
            self._pending_rng = states[rank]


def _lr_ratio(step: int, *, lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    return lr_at(step, lr, min_lr, warmup_steps, decay_steps) / lr

