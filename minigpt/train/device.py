"""The machine a run trains on: which device, in which precision, whether it compiles, and
Lightning Fabric for the plan (``build_fabric``; FSDP with one unit per transformer block)."""

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


def default_precision(accelerator: str) -> str:
    """Lightning precision for a device: mixed in ``minigpt.devices.preferred_dtype``'s number
    type (``bf16-mixed`` where bf16 is native, ``16-mixed`` on older GPUs), else ``32-true``."""
    device_type = {"gpu": "cuda", "cpu": "cpu"}.get(resolve_accelerator(accelerator))
    if device_type is None or (device_type == "cuda" and not torch.cuda.is_available()):
        return "32-true"
    dtype = preferred_dtype(device_type, has_native_bf16(device_type))
    return {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}.get(dtype, "32-true")


def fsdp_mixed_precision(precision: str):
    """FSDP's ``MixedPrecision`` for a ``*-mixed`` precision (else None: Lightning's): parameters
    unsharded in the half type, gradients reduced and buffers kept in float32 (a bf16 sum over
    many ranks loses the small contributions); each Block unit casts its input, so a forward
    outside training (sampling) feeds the blocks what training does."""
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
    """The device's dense peak FLOP/s in ``dtype`` for MFU: ``DENSE_PEAK_FLOPS``, else
    Lightning's ``get_available_flops``; None where neither knows the device."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        for fragment, flops in DENSE_PEAK_FLOPS.items():  # the more specific name first
            if fragment in name and dtype in flops:
                return flops[dtype]
    from lightning.fabric.utilities.throughput import get_available_flops

    return get_available_flops(device, dtype)


def build_fabric(trainer: TrainerSchema, plan, loggers: list, callbacks=()) -> Fabric:
    """The Fabric for ``plan`` (it launches nothing until ``fabric.launch()``); Lightning's own
    refusals come back as one ``ConfigError`` line."""
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
    """One FSDP unit per transformer block; sharded checkpoints (a shard per rank) or one full
    file gathered on rank 0."""
    return FSDPStrategy(
        auto_wrap_policy={Block},
        sharding_strategy=fsdp.sharding_strategy,
        state_dict_type="sharded" if plan.sharded_checkpoints else "full",
        use_orig_params=True,
        mixed_precision=fsdp_mixed_precision(plan.precision),
    )
