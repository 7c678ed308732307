"""Lightning Fabric for a run: accelerator, devices and nodes from the ``trainer`` group, the
strategy (FSDP with one unit per transformer block and float32 gradient reduction), precision,
loggers and hooks. Activation checkpointing is not Fabric's here: the blocks are checkpointed
before Fabric wraps them, on every strategy alike (``minigpt.train.activation_checkpointing``)."""

from __future__ import annotations

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import FSDPStrategy

from minigpt.checkpoint.write import DirectCheckpointIO
from minigpt.config.schema import FSDPSchema, TrainerSchema
from minigpt.errors import ConfigError
from minigpt.model import Block
from minigpt.train.device import fsdp_mixed_precision
from minigpt.train.plan import RunPlan


def build_fabric(trainer: TrainerSchema, plan: RunPlan, loggers: list, callbacks=()) -> Fabric:
    """The Fabric for ``plan`` (it launches nothing until ``fabric.launch()``). Lightning's own
    checks (no GPU for accelerator=gpu, FSDP on a CPU, an unknown strategy) come back as one
    ``ConfigError`` line."""
    try:
        return Fabric(
            accelerator=trainer.accelerator, devices=trainer.devices, num_nodes=trainer.num_nodes,
            strategy=fsdp_strategy(plan, trainer.fsdp) if plan.fsdp else plan.strategy,
            precision=plan.precision, loggers=loggers, callbacks=list(callbacks),
            plugins=None if plan.fsdp else [DirectCheckpointIO()],  # FSDP writes in place
        )
    except (ValueError, TypeError, RuntimeError) as e:
        if plan.fsdp and not torch.cuda.is_available():  # Fabric's words name its own API
            raise ConfigError("trainer.strategy=fsdp runs on GPUs and this machine has none "
                              "(CUDA is not available); use trainer=ddp trainer.accelerator=cpu "
                              "for several CPU processes, or trainer=cpu") from None
        raise ConfigError(f"trainer: {' '.join(str(e).split())}") from None


def fsdp_strategy(plan: RunPlan, fsdp: FSDPSchema):
    """One FSDP unit per transformer block (each checkpointed inside its unit when the run asks,
    before wrapping); sharded checkpoints (each rank writes its shard, resumable on any number of processes) or
    one full file gathered into rank 0's memory."""
    return FSDPStrategy(
        auto_wrap_policy={Block},
        sharding_strategy=fsdp.sharding_strategy,
        state_dict_type="sharded" if plan.sharded_checkpoints else "full",
        use_orig_params=True,
        mixed_precision=fsdp_mixed_precision(plan.precision),
    )
