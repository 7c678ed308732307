"""Activation checkpointing per transformer block (``trainer.activation_checkpointing``):
``none`` keeps all that backward needs; ``blocks`` keeps each block's input and reruns its
forward in backward; ``selective`` also keeps the matmuls' and the attention's outputs
(``SELECTIVE_SAVES``). Applied in place before Fabric wraps and before anything compiles; the
state-dict keys stay the model's, and a call without gradients runs the plain forward.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from minigpt.config.schema import ActivationCheckpointing


def _ops(*names: str) -> tuple:
    """The ATen / oneDNN overloads of ``names`` that this build of torch has."""
    found = []
    for name in names:
        namespace, _, op = name.partition(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None:
            found += [getattr(packet, overload) for overload in packet.overloads()]
    return tuple(found)


# What `selective` keeps: the outputs of the matmuls (plain linears, minigpt.cpu's oneDNN ones)
# and of the attention (every SDPA kernel). Recomputing them is most of a block's FLOPs; what is
# left to recompute (norms, GELU, residual adds) is memory-bound and cheap.
MATMUL_OPS = ("aten.mm", "aten.addmm", "aten.bmm", "mkldnn._linear_pointwise")
ATTENTION_OPS = ("aten._scaled_dot_product_flash_attention",
                 "aten._scaled_dot_product_flash_attention_for_cpu",
                 "aten._scaled_dot_product_efficient_attention",
                 "aten._scaled_dot_product_cudnn_attention")
SELECTIVE_SAVES = MATMUL_OPS + ATTENTION_OPS


def apply_activation_checkpointing(model: nn.Module, mode: str | ActivationCheckpointing,
                                   saved_ops: tuple[str, ...] = SELECTIVE_SAVES) -> int:
    """Checkpoint each of ``model.blocks`` in ``mode`` (``none``: leave them); returns how many
    blocks it changed. ``saved_ops``: the ops whose outputs ``selective`` keeps (names as
    ``torch.ops`` spells them; ``bench/memory.py`` compares splits)."""
    mode = ActivationCheckpointing(mode)
    if mode is ActivationCheckpointing.none:
        return 0
    run = functools.partial(checkpoint, use_reentrant=False)
    if mode is ActivationCheckpointing.selective:
        run = functools.partial(run, context_fn=functools.partial(
            create_selective_checkpoint_contexts, list(_ops(*saved_ops))))
    blocks = list(model.blocks)
    for block in blocks:
        if getattr(block.forward, "activation_checkpointing", None) is None:
            block.forward = _checkpointed(block.forward, mode, run)
    return len(blocks)


def checkpointing_of(block: nn.Module) -> ActivationCheckpointing:
    """The mode ``block`` runs in."""
    return getattr(block.forward, "activation_checkpointing", ActivationCheckpointing.none)


def _checkpointed(forward, mode: ActivationCheckpointing, run_checkpointed):
    # torch.compile traces the checkpoint call (a partial, as torch's checkpoint_wrapper makes)
    # into one region that it recomputes in backward
    def checkpointed_forward(*args, **kwargs):
        if not torch.is_grad_enabled():  # nothing is kept for a backward that never comes
            return forward(*args, **kwargs)
        return run_checkpointed(forward, *args, **kwargs)

    checkpointed_forward.activation_checkpointing = mode
    return checkpointed_forward
