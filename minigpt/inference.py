"""The one inference loader: a training checkpoint or a Hugging Face GPT-2 directory -> a model
and its tokenizer on a device, in a number type (generate.py, eval and viz alike).

Two steps, so generate can draw attention maps from the float32 model between them:
``load_for_inference`` checks ``device`` and ``dtype`` before reading any file and reads the
model (float32, CPU); ``LoadedModel.place`` moves and casts it. ``dtype=auto`` follows
``minigpt.devices.preferred_dtype``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from minigpt.chat.template import ChatTemplate, read_chat_template
from minigpt.checkpoint import METADATA_KEY, load_model, read_checkpoint
from minigpt.devices import check_device, inference_dtype
from minigpt.errors import UserError
from minigpt.model import GPT
from minigpt.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    """A model and its tokenizer read for inference, with where and how it is to run."""

    model: GPT
    tokenizer: Tokenizer
    source: str  # the file or directory it came from
    device: str  # checked to exist on this machine
    dtype: torch.dtype  # the weights' (``place``) or the autocast's (``place(cast_weights=False)``)
    applied: list[str] = field(default_factory=list)  # CPU speedups ``place`` applied
    chat_template: ChatTemplate | None = None  # a fine-tuned chat model's; None: a base model

    def place(self, cpu_speedups: bool = True, *, cast_weights: bool = True,
              traceable: bool = False) -> list[str]:
        """``place_model`` for this model on its device in its dtype: the speedups applied."""
        self.applied = place_model(self.model, self.device, self.dtype, cpu_speedups,
                                   cast_weights=cast_weights, traceable=traceable)
        return self.applied

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context a forward pass of float32 weights runs in to compute in ``dtype``."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(self.device).type, self.dtype)

    def scoring_autocast(self) -> Callable[[], contextlib.AbstractContextManager] | None:
        """For float32 weights (``place(cast_weights=False)``): the autocast that computes in
        ``dtype``, as training's evaluation does; ``None`` for float32."""
        return None if self.dtype == torch.float32 else self.autocast

    def describe(self) -> str:
        """One line: source, size, tokenizer, context, device and dtype."""
        return (f"{self.source}: {self.model.num_params() / 1e6:.2f}M parameters, tokenizer "
                f"{self.tokenizer.name!r}, context {self.model.config.context_length}, "
                f"{self.device} {str(self.dtype).removeprefix('torch.')}")


def load_for_inference(ckpt_path=None, pretrained=None, checkpoints_root="outputs", *,
                       device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Check ``device`` and ``dtype``, then read the model (``minigpt.checkpoint.load_model``:
    ``pretrained``, ``ckpt_path`` or the newest ``last.ckpt`` under ``checkpoints_root``),
    float32 on the CPU in eval mode, with a chat model's ``chat_template``; ``place`` it."""
    device = check_device(device)
    weights_dtype = inference_dtype(dtype, device)
    model, tokenizer, source = load_model(ckpt_path, pretrained, checkpoints_root)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} tokens but the "
                        f"model only {model.config.vocab_size}")
    template = None if pretrained is not None else read_chat_template(
        read_checkpoint(source)[METADATA_KEY], tokenizer)  # memory-mapped: a cheap second read
    return LoadedModel(model, tokenizer, source, device, weights_dtype, chat_template=template)


def load_for_scoring(ckpt_path=None, pretrained=None, checkpoints_root="outputs", *,
                     device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """``load_for_inference``, placed for scoring: float32 weights on the device, forward passes
    under ``scoring_autocast()``."""
    loaded = load_for_inference(ckpt_path, pretrained, checkpoints_root, device=device,
                                dtype=dtype)
    loaded.place(cast_weights=False)
    return loaded


def place_model(model: GPT, device: str, dtype: torch.dtype, cpu_speedups: bool = True, *,
                cast_weights: bool = True, traceable: bool = False) -> list[str]:
    """Move ``model`` to ``device``; with ``cast_weights`` in ``dtype`` (on the CPU with
    ``cpu_speedups``, as ``minigpt.cpu``'s decoding layouts instead; ``traceable``: the one a
    compiled step streams), else float32. A GPU uses TF32. Returns the speedups applied."""
    model.to(device)
    if device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")
    applied = []
    if cast_weights and cpu_speedups and dtype in (torch.float32, torch.bfloat16):
        from minigpt.cpu import speed_up_decoding  # a no-op off the CPU

        applied = speed_up_decoding(model, weight_dtype=dtype, traceable=traceable)
    if cast_weights and not applied:
        model.to(dtype)
    return applied
