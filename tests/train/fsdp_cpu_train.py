"""``train.py`` with Lightning Fabric's FSDP strategy let through on CPU processes (gloo), for
tests only.

    python tests/train/fsdp_cpu_train.py trainer=fsdp trainer.accelerator=cpu trainer.devices=2 ...

Four device guards are lifted, nothing else changes: Fabric rejects ``FSDPStrategy`` itself on
a CPU (a subclass passes its check); FSDP needs ``device_id=cpu`` to keep CPU parameters (Fabric
passes the device index, None on a CPU); gathering a full state dict with ``offload_to_cpu=True``
crashes when the parameters already live on the CPU (torch 2.13), so it is gathered without
offload; Fabric's FSDP precision plugin autocasts on ``cuda`` only, so under ``bf16-mixed`` it
autocasts on the CPU here. On GPUs Fabric runs the unchanged code.
"""

import contextlib
import sys
from pathlib import Path

import lightning.fabric.strategies as strategies
import lightning.fabric.strategies.fsdp as fabric_fsdp
import torch
import torch.distributed.fsdp as fsdp
from lightning.fabric.plugins.precision.fsdp import FSDPPrecision


class CPUFSDPStrategy(strategies.FSDPStrategy):
    """Fabric's accelerator check rejects ``type(strategy) is FSDPStrategy`` on a CPU."""


class CPUFullyShardedDataParallel(fsdp.FullyShardedDataParallel):
    def __init__(self, module, *args, device_id=None, **kwargs):
        device_id = torch.device("cpu") if device_id is None else device_id
        super().__init__(module, *args, device_id=device_id, **kwargs)


@contextlib.contextmanager
def full_state_dict_without_offload(module, world_size, rank0_only=True):
    config = fsdp.FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only)
    optim_config = fsdp.FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only)
    with fsdp.FullyShardedDataParallel.state_dict_type(
        module, fsdp.StateDictType.FULL_STATE_DICT, config, optim_config
    ):
        yield


def cpu_autocast(self):
    if "mixed" in self.precision:
        dtype = torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16
        return torch.autocast("cpu", dtype=dtype)
    return original_forward_context(self)


original_forward_context = FSDPPrecision.forward_context
FSDPPrecision.forward_context = cpu_autocast
strategies.FSDPStrategy = CPUFSDPStrategy
fsdp.FullyShardedDataParallel = CPUFullyShardedDataParallel
fabric_fsdp._get_full_state_dict_context = full_state_dict_without_offload

# Run train.py as the main script; Fabric starts the other rank with this file's sys.argv.
train_py = Path(__file__).resolve().parents[2] / "train.py"
sys.path.insert(0, str(train_py.parent))
exec(compile(train_py.read_text(), str(train_py), "exec"),
     {"__name__": "__main__", "__file__": str(train_py)})
