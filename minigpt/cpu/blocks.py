"""Compile the training forward of blocks whose options have no fused CPU kernel.

GPT-2's block runs on fused CPU kernels: LayerNorm's forward and backward and GELU are one pass
over memory each. The modern block options are not: ``nn.RMSNorm`` (no fused CPU backward),
QK-norm, rotary embeddings and ReLU² run as chains of small elementwise operations, each reading
and writing the whole activation again, forward and backward. ``torch.compile`` fuses each chain
into one loop; compiling the block (regional compilation) rather than the whole model leaves the
LM-head loss to ``minigpt.cpu.loss`` and gives one graph that every block shares.

Only the training call is compiled: no padding and no cache (the loss's path). Decoding
(``kv_cache``, one token at a time, growing shapes) would recompile at every new length, so those
calls stay eager. The block keeps its class, parameters and state-dict keys.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn


def unfused_options(config) -> list[str]:
    """The ``GPTConfig`` options of ``config`` that run unfused on the CPU when eager."""
    options = []
    if config.norm == "rmsnorm":
        options.append("norm=rmsnorm")
    if config.qk_norm:
        options.append("qk_norm")
    if config.position == "rope":
        options.append("position=rope")
    if config.mlp == "relu2":
        options.append("mlp=relu2")
    return options


@functools.cache
def compiler_works() -> bool:
    """Whether ``torch.compile`` builds CPU code here (it needs a C++ compiler): one tiny
    function compiled once per process (later processes hit inductor's on-disk cache)."""
    try:
        torch.compile(lambda x: x * 2 + 1, dynamic=False)(torch.ones(4))
    except Exception:  # noqa: BLE001 - any failure means: stay eager
        return False
    return True


def compile_training_forward(block: nn.Module) -> None:
    """Route ``block``'s training call (no padding, no cache) through a compiled forward, in
    place; any other call takes the eager forward."""
    eager = block.forward
    compiled = torch.compile(eager)

    def forward(x: Tensor, key_padding_mask: Tensor | None = None, kv_cache=None,
                position_ids: Tensor | None = None,
                value_embedding: Tensor | None = None,
                document_ids: Tensor | None = None) -> Tensor:
        if key_padding_mask is None and kv_cache is None:
            return compiled(x, None, None, position_ids, value_embedding, document_ids)
        return eager(x, key_padding_mask, kv_cache, position_ids, value_embedding, document_ids)

    forward.compiled_for_training = True
    block.forward = forward  # an instance attribute: the class and its other instances unchanged


def is_compiled_for_training(block: nn.Module) -> bool:
    return getattr(block.forward, "compiled_for_training", False)
