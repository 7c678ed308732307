"""One rank of tests/train/test_fsdp.py: ``torchrun --nproc_per_node 2 tests/train/fsdp_worker.py OUT_DIR``.

Wraps a tiny GPT the way Fabric's FSDPStrategy does with our settings (ModelWithLoss as
the root unit, one unit per Block, FULL_SHARD, use_orig_params), trains a few steps on this
rank's half of each batch, then writes (rank-wise JSON) how far the gathered parameters are from
a plain single-process model trained on the whole batches, and the greedy sample each gives.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from minigpt.model import GPT, Block, GPTConfig
from minigpt.sampling import generate
from minigpt.train.loop import gathered_parameters
from minigpt.train.optim import param_groups


class Root(nn.Module):
    """Stands in for ModelWithLoss: the loop runs a step through the root unit's forward."""

    def __init__(self, model: GPT):
        super().__init__()
        self.model = model

    def forward(self, idx, targets):
        return self.model.loss(idx, targets)


def train(model_or_root, step_inputs, clip):
    optimizer = torch.optim.AdamW(param_groups(model_or_root, 0.1), lr=1e-2)
    for idx, targets in step_inputs:
        loss = model_or_root(idx, targets)
        loss.backward()
        clip(model_or_root)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=128, context_length=32, n_layer=2, n_head=2, n_embd=32,
                       dropout=0.0)
    reference = Root(GPT(config))
    sharded_model = GPT(config)
    sharded_model.load_state_dict(reference.model.state_dict())
    root = FullyShardedDataParallel(
        Root(sharded_model), auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True,
        device_id=torch.device("cpu"),  # FSDP's default is an accelerator
    )
    initial = {n: p.detach().clone() for n, p in reference.model.named_parameters()}
    data = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, (2 * world, 33), generator=data) for _ in range(3)]
    mine = slice(2 * rank, 2 * rank + 2)
    train(root, [(b[mine, :-1], b[mine, 1:]) for b in batches], lambda m: m.clip_grad_norm_(0.5))
    train(reference, [(b[:, :-1], b[:, 1:]) for b in batches],
          lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))

    prompt = torch.tensor([[1, 2, 3]])
    with gathered_parameters(root):  # what the sampling callback does
        sample = generate(sharded_model, prompt, 8, temperature=0.0)[0].tolist()
    with gathered_parameters(root, recurse=True):
        gathered = {name.replace("_fsdp_wrapped_module.", ""): p  # FSDP's unit prefix
                    for name, p in sharded_model.named_parameters()}
        max_diff = max((gathered[n] - p).abs().max().item()
                       for n, p in reference.model.named_parameters())
    moved = max((p - initial[n]).abs().max().item() for n, p in reference.model.named_parameters())
    result = {"max_param_diff": max_diff, "moved": moved, "sample": sample,
              "reference_sample": generate(reference.model, prompt, 8, temperature=0.0)[0].tolist()}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # as train.py ends: no rank tears the group down while another is in it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # The results are written: skip the interpreter's teardown, where freeing gloo's and FSDP's
    # objects can abort a finished process (SIGABRT, "terminate called without an active
    # exception"; once in CI), which is PyTorch's and not what this test checks.
    sys.stdout.flush()
    os._exit(0)
