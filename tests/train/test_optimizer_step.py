"""``minigpt.train.loop.optimizer_step``, the loop's step callable alone (what ``bench`` times),
against the same step written out by hand: accumulation, clipping, AdamW, the schedule."""

from __future__ import annotations

import copy

import torch
from lightning.fabric import Fabric

from minigpt.model import GPT, GPTConfig
from minigpt.train.loop import ModelWithLoss, optimizer_step
from minigpt.train.optim import build_optimizers, schedule_for

OPTIM = {"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 1, "decay_steps": 10, "weight_decay": 0.1,
         "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}


def test_optimizer_step_equals_the_step_written_out():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, context_length=8, n_layer=2, n_head=2, n_embd=16))
    by_hand = copy.deepcopy(model)
    batches = [tuple(torch.randint(0, 32, (2, 2, 8))) for _ in range(4)]  # 2 steps x 2 micro

    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    module = fabric.setup_module(ModelWithLoss(model))
    optimizer = build_optimizers(module, OPTIM, fused=False)["optimizer"]
    scheduler = schedule_for(optimizer, OPTIM)
    optimizers = {"optimizer": fabric.setup_optimizers(optimizer)}

    def clip():
        return torch.nn.utils.clip_grad_norm_(module.parameters(), 0.5)

    stream = iter(batches)
    results = [optimizer_step(fabric, module, optimizers, {"optimizer": scheduler}, stream,
                              accumulate=2, clip_gradients=clip) for _ in range(2)]

    hand_optimizer = build_optimizers(by_hand, OPTIM, fused=False)["optimizer"]
    hand_scheduler = schedule_for(hand_optimizer, OPTIM)
    for step in range(2):
        losses = [by_hand.loss(x, y) / 2 for x, y in batches[2 * step: 2 * step + 2]]
        sum(losses).backward()
        norm = torch.nn.utils.clip_grad_norm_(by_hand.parameters(), 0.5)
        lr = hand_optimizer.param_groups[0]["lr"]
        hand_optimizer.step()
        hand_scheduler.step()
        hand_optimizer.zero_grad(set_to_none=True)
        loss, grad_norm, lrs = results[step]
        torch.testing.assert_close(loss, sum(losses).detach())
        torch.testing.assert_close(grad_norm, norm)
        assert lrs == {"lr": lr}
    for ours, theirs in zip(model.parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs)
        assert ours.grad is None  # zero_grad(set_to_none=True)
