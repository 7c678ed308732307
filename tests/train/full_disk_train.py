"""``train.py`` on a disk that fills during its second checkpoint, for tests only.

    python tests/train/full_disk_train.py trainer=ddp trainer.accelerator=cpu trainer.devices=2 ...

The first ``torch.save`` to a file writes; the second writes 1000 bytes and then fails with the file
layer's ``ENOSPC``, on global rank 0 only (under DDP the only process that writes the file).
Nothing else changes.
"""

import errno
import sys
from pathlib import Path

import torch

real_save = torch.save
saves = []


def save_until_full(obj, f, *args, **kwargs):
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank != 0 or not isinstance(f, (str, Path)):  # not a file: pickling (collectives do)
        return real_save(obj, f, *args, **kwargs)
    saves.append(f)
    if len(saves) == 1:
        return real_save(obj, f, *args, **kwargs)
    Path(f).write_bytes(b"\0" * 1000)
    raise OSError(errno.ENOSPC, "No space left on device")


torch.save = save_until_full

# Run train.py as the main script; Fabric starts the other rank with this file's sys.argv.
train_py = Path(__file__).resolve().parents[2] / "train.py"
sys.path.insert(0, str(train_py.parent))
exec(compile(train_py.read_text(), str(train_py), "exec"),
     {"__name__": "__main__", "__file__": str(train_py)})
