"""The training loop's own optimizer step (``minigpt.train.loop.optimizer_step``), set up for a
benchmark as ``train.py`` sets up a run on one device: Lightning Fabric with the run's precision,
the model inside ``ModelWithLoss`` (its loss compiled when asked), ``build_optimizers`` and each
optimizer's schedule, the optimizers set up by Fabric, the global gradient norm clipped at
``optim.grad_clip``. What a benchmark times is then what a training step runs.

Shape letters: B batch, T tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from lightning.fabric import Fabric
from torch import Tensor, nn

from bench.recipe_configs import optim_settings
from minigpt.train.loop import ModelWithLoss, clip_gradients, optimizer_step
from minigpt.train.optim import build_optimizers, schedule_for
from tests.oracles import logits_cross_entropy


class CausalLMWithLoss(nn.Module):
    """A ``transformers`` causal LM behind ``GPT.loss``'s interface, so the loop can step it:
    (B, T) tokens and targets in, the mean cross-entropy of its logits out. ``attention``: a
    context manager entered around its forward (e.g. to change how it calls SDPA)."""

    def __init__(self, lm: nn.Module, attention=contextlib.nullcontext):
        super().__init__()
        self.lm, self.attention = lm, attention

    def loss(self, x: Tensor, y: Tensor, document_ids: Tensor | None = None) -> Tensor:
        assert document_ids is None, "transformers' GPT-2 has no document mask"
        with self.attention():
            logits = self.lm(x).logits  # (B, T, V)
        return logits_cross_entropy(logits, y)


def loop_step(model: nn.Module, optim: dict | None = None, *, precision: str = "32-true",
              accelerator: str = "cpu", compile: bool = False,
              fullgraph: bool = True) -> Callable[[Tensor, Tensor], Tensor]:
    """``step(x, y)``: one optimizer step of the loop on ``model`` (anything with
    ``loss(x, y)``) for the batch x, y (B, T), returning the loss on the device. ``optim``: the
    optim settings (default: ``python train.py``'s); ``precision``, ``accelerator``: Fabric's;
    ``compile``: the loss compiled as one graph (``fullgraph``), as ``compile=auto`` does."""
    optim = optim or optim_settings()
    fabric = Fabric(accelerator=accelerator, devices=1, precision=precision)
    module = fabric.setup_module(ModelWithLoss(model, compile, fullgraph=fullgraph))
    fused = optim.get("fused", True) and not precision.startswith("16")
    built = build_optimizers(module, optim, fused=fused)
    schedulers = {name: schedule_for(o, optim) for name, o in built.items()}
    optimizers = {name: fabric.setup_optimizers(o) for name, o in built.items()}

    def clip() -> Tensor:  # the loop's clipping, on one device
        return clip_gradients(fabric, module, optim.get("grad_clip"),
                              optimizers["optimizer"] if precision.startswith("16") else None)

    def step(x: Tensor, y: Tensor) -> Tensor:
        return optimizer_step(fabric, module, optimizers, schedulers, iter([(x, y)]),
                              clip_gradients=clip)[0]
    return step
