"""Compile the training forward of blocks whose options have no fused CPU kernel (RMSNorm,
QK-norm, rotary embeddings, ReLU²: eagerly, chains of small elementwise passes over memory), one
block at a time, so that every block shares one graph and the loss stays ``minigpt.cpu.loss``'s.
Only the training call (no padding, no cache) is compiled: decoding's growing shapes would
recompile at every length. The block keeps its class, parameters and state-dict keys.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn


def compile_blocks(model: nn.Module) -> list[str]:
    """Compile the training forward of ``model.blocks`` when their options run unfused; the
    line saying so, or why not (none for blocks that run fused)."""
    config, blocks = getattr(model, "config", None), getattr(model, "blocks", None)
    options = unfused_options(config) if config is not None and blocks is not None else []
    if not options:
        return []
    if config.window is not None:
        return [f"eager blocks ({', '.join(options)}; window: not compiled)"]
    if not compiler_works():
        return [f"eager blocks ({', '.join(options)}; torch.compile found no C++ compiler)"]
    compiled = sum(compile_training_forward(block) for block in blocks)
    return [f"compiled blocks ({', '.join(options)}) ({compiled})"] if compiled else []


def unfused_options(config) -> list[str]:
    """The ``GPTConfig`` options of ``config`` that run unfused on the CPU when eager."""
    unfused = {"norm=rmsnorm": config.norm == "rmsnorm", "qk_norm": config.qk_norm,
               "position=rope": config.position == "rope", "mlp=relu2": config.mlp == "relu2"}
    return [name for name, on in unfused.items() if on]


@functools.cache
def compiler_works() -> bool:
    """Whether ``torch.compile`` builds CPU code here (it needs a C++ compiler): one tiny
    function compiled once per process (later processes hit inductor's on-disk cache)."""
    try:
        torch.compile(lambda x: x * 2 + 1, dynamic=False)(torch.ones(4))
    except Exception:  # noqa: BLE001 - any failure means: stay eager
        return False
    return True


def compile_training_forward(block: nn.Module) -> bool:
    """Route ``block``'s training call (no padding, no cache) through a compiled forward, in
    place; any other call takes the eager forward. False when it already was."""
    if is_compiled_for_training(block):
        return False
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
    return True


def is_compiled_for_training(block: nn.Module) -> bool:
    return getattr(block.forward, "compiled_for_training", False)
