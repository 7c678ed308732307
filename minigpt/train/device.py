"""The machine a run trains on: which device, in which precision, whether it compiles, and
Lightning Fabric for the plan (``build_fabric``: accelerator, devices and nodes from the
``trainer`` group, the strategy (FSDP with one unit per transformer block and float32 gradient
reduction), precision, loggers and hooks). Activation checkpointing is not Fabric's here: the blocks are checkpointed before Fabric
wraps them, on every strategy alike (``minigpt.train.activation_checkpointing``)."""

from __future__ import annotations

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import FSDPStrategy

from minigpt.checkpoint.write import DirectCheckpointIO
from minigpt.config.schema import FSDPSchema, TrainerSchema
from minigpt.devices import has_native_bf16, preferred_dtype
from minigpt.errors import ConfigError
from minigpt.model import Block


def resolve_accelerator(accelerator: str | None) -> str:
    """``cpu`` or ``gpu`` for Lightning's ``auto`` (what Lightning itself picks); other names
    (``mps``, ``tpu``...) as given."""
    if accelerator in (None, "auto"):
        return "gpu" if torch.cuda.is_available() else "cpu"
    return "gpu" if accelerator == "cuda" else accelerator


# Lightning's name for training in each of the rule's number types (a grad scaler under float16).
MIXED_PRECISION = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed",
                   torch.float32: "32-true"}


def default_precision(accelerator: str) -> str:
    """Lightning precision for a device: mixed precision in the one number type that
    ``minigpt.devices.preferred_dtype`` picks for it (``bf16-mixed`` where the hardware
    multiplies bf16 natively, ``16-mixed`` on older GPUs), ``32-true`` elsewhere (a GPU
    accelerator on a machine without one, other accelerators)."""
    device_type = {"gpu": "cuda", "cpu": "cpu"}.get(resolve_accelerator(accelerator))
    if device_type is None or (device_type == "cuda" and not torch.cuda.is_available()):
        return "32-true"
    return MIXED_PRECISION[preferred_dtype(device_type, has_native_bf16(device_type))]


def fsdp_mixed_precision(precision: str):
    """FSDP's ``MixedPrecision`` for a Lightning precision: parameters unsharded in the half
    type for the matmuls, gradients reduced and buffers kept in float32 (a sum over many ranks
    in bf16 loses the small contributions). None where FSDP needs no casting (``32-true``) or
    the user chose a pure half-precision run (``bf16-true``), which Lightning configures.

    ``cast_forward_inputs``: each Block unit casts its input to the half type, so a forward
    outside training (sampling, where only the root's parameters are gathered, in float32) feeds
    the blocks what training feeds them."""
    half = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(str(precision))
    if half is None:
        return None
    from torch.distributed.fsdp import MixedPrecision

    return MixedPrecision(param_dtype=half, reduce_dtype=torch.float32, buffer_dtype=torch.float32,
                          cast_forward_inputs=True)


def compile_enabled(compile_option, accelerator: str | None) -> bool:
    """``compile: auto`` is on for GPUs (the compiled forward + loss is much faster there) and
    off on CPUs (compiling takes long to start on a few cores); true/false as given."""
    if compile_option == "auto":
        return resolve_accelerator(accelerator) == "gpu"
    return bool(compile_option)


# Dense (no sparsity) peak FLOP/s of GPUs that Lightning's table misses or counts with sparsity:
# an H200 reports itself as "NVIDIA H200", which Lightning 2.6 does not match, and its H200
# entries are the 2:4-sparse figures, twice the dense ones its H100 entries give.
DENSE_PEAK_FLOPS = {
    "h200 nvl": {torch.bfloat16: 835.5e12, torch.float16: 835.5e12, torch.float32: 60e12},
    "h200": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.float32: 67e12},
}


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense peak FLOP/s in ``dtype`` for MFU (``float32`` meaning TF32 matmuls
    off): ``DENSE_PEAK_FLOPS`` for the GPUs it names, else Lightning's ``get_available_flops``;
    None where neither knows the device (``peak_flops`` in the config gives it)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        for fragment, flops in DENSE_PEAK_FLOPS.items():  # the more specific name first
            if fragment in name and dtype in flops:
                return flops[dtype]
    from lightning.fabric.utilities.throughput import get_available_flops

    return get_available_flops(device, dtype)


def build_fabric(trainer: TrainerSchema, plan, loggers: list, callbacks=()) -> Fabric:
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


def fsdp_strategy(plan, fsdp: FSDPSchema):
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
