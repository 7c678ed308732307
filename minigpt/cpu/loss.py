"""Cross-entropy over the LM head without materializing the (N, V) logits, for CPU training.

``linear_cross_entropy(h, W, targets)`` equals ``F.cross_entropy((h @ W.T).float(), targets)``
(of the soft-capped logits with ``softcap``) but walks the rows in chunks through one reused
buffer, computing the gradients of ``h`` and ``W`` there, so backward only scales them. Under
autocast the matmuls run in its dtype, the softmax in float32. ``ChunkedNextTokenLoss`` puts it
in the model's place (``minigpt.cpu.speed_up_training``). Shape letters: N rows (B * T),
C features, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from minigpt.model import NextTokenLoss

# Logits per chunk (128 MiB in float32): big enough that each chunk's matmuls run at full speed
# and the (V, C) weight gradient is not re-accumulated too often.
_CHUNK_ELEMENTS = 2**25


def linear_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = -100,
                         chunk_rows: int | None = None, softcap: float | None = None) -> Tensor:
    """Mean cross-entropy (float32 scalar; NaN if every target is ignored) of the logits
    ``h @ weight.T`` (soft-capped in float32 when ``softcap`` is given) for ``h`` (N, C),
    ``weight`` (V, C) and ``targets`` (N,) int, ignoring ``ignore_index``."""
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise ValueError(f"need h (N, C) and weight (V, C), got {tuple(h.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != h.shape[:1]:
        raise ValueError(f"targets must have shape ({h.shape[0]},), got {tuple(targets.shape)}")
    chunk = chunk_rows or max(1, _CHUNK_ELEMENTS // weight.shape[0])
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(h, weight, targets, ignore_index, chunk, softcap)
    loss, _, _ = _forward(h, weight, targets, ignore_index, chunk, softcap, need_grads=False)
    return loss


def _forward(h: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, chunk: int,
             softcap: float | None, need_grads: bool
             ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    device = h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
    hc, wc = h.detach().to(dtype), weight.detach().to(dtype)
    N, V = h.shape[0], weight.shape[0]
    valid = targets != ignore_index  # (N,)
    n_valid = valid.sum()
    safe_targets = targets.masked_fill(~valid, 0)
    losses = torch.empty(N, dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(hc) if need_grads else None
    grad_w = None
    scale = 1.0 / n_valid.clamp(min=1).to(torch.float32)
    chunk = -(-N // -(-N // chunk))  # equal chunks (no small last one) of at most `chunk` rows
    rows = min(chunk, N)
    # Buffers reused by every chunk: fresh large tensors cost page faults on each allocation.
    logits = torch.empty(rows, V, dtype=dtype, device=h.device)
    logits32 = logits if dtype == torch.float32 else torch.empty(rows, V, device=h.device)
    probs_buffer = torch.empty(rows, V, device=h.device)
    capped_buffer = torch.empty(rows, V, device=h.device) if softcap is not None else None
    for start in range(0, N, chunk):
        end = min(start + chunk, N)
        n = end - start
        z = torch.mm(hc[start:end], wc.t(), out=logits[:n])  # (n, V)
        z32 = z if dtype == torch.float32 else logits32[:n].copy_(z)
        tanh = None
        if softcap is not None:  # z32 keeps tanh(z / cap) for the backward, z32 the capped logits
            tanh = z32.div_(softcap).tanh_()
            z32 = torch.mul(tanh, softcap, out=capped_buffer[:n])
        probs = torch._softmax(z32, -1, False, out=probs_buffer[:n])  # float32
        t = safe_targets[start:end, None]  # (n, 1)
        row_loss = probs.gather(1, t).squeeze(1).log_().neg_()  # -log p(target)
        # Where p(target) nears float32 underflow, exactly: -log p = m - z_t - log p_max, m the
        # row's largest logit, whose probability (>= 1/V) never underflows. Selected, not
        # branched on: a branch would copy the condition to the host at every micro-batch.
        top = probs.argmax(1, keepdim=True)  # (n, 1)
        exact = (z32.gather(1, top) - z32.gather(1, t) - probs.gather(1, top).log()).squeeze(1)
        row_loss = torch.where(row_loss > 60.0, exact, row_loss)
        row_scale = valid[start:end] * scale  # (n,): 1 / n_valid, 0 on ignored rows
        losses[start:end] = row_loss * (row_scale > 0)
        if need_grads:
            # d(mean loss)/d logits = (softmax - one_hot) * row_scale.
            probs.scatter_add_(1, t, torch.full_like(t, -1, dtype=probs.dtype))
            if tanh is not None:  # through the cap: d(cap tanh(z / cap))/dz = 1 - tanh²
                probs.mul_(tanh.square_().neg_().add_(1.0))
            # In the matmul dtype, as autocast's backward would use; z is free to reuse.
            g = probs if dtype == torch.float32 else z.copy_(probs)
            grad_w = _chunk_grads(g, hc[start:end], wc, row_scale, grad_h[start:end], grad_w)
    loss = losses.sum() / n_valid.to(torch.float32)
    return loss, grad_h, grad_w


def _chunk_grads(g: Tensor, h_rows: Tensor, wc: Tensor, row_scale: Tensor, grad_h_rows: Tensor,
                 grad_w: Tensor | None) -> Tensor:
    """Write this chunk's input gradient into ``grad_h_rows`` (n, C) and add its weight gradient
    to ``grad_w`` (None for the first chunk); return ``grad_w`` (V, C). ``g`` (n, V) is softmax -
    one-hot; the row scale goes on the (n, C) operands: one pass over the logits fewer."""
    dtype = g.dtype
    torch.mm(g, wc, out=grad_h_rows)  # (n, C)
    grad_h_rows.mul_(row_scale[:, None].to(dtype))
    h_scaled = h_rows * row_scale[:, None].to(dtype)  # (n, C)
    if grad_w is None:
        return torch.mm(g.t(), h_scaled).float()  # (V, C)
    if dtype == torch.float32:  # accumulated inside the matmul
        return torch.addmm(grad_w, g.t(), h_scaled, out=grad_w)
    return grad_w.add_(torch.mm(g.t(), h_scaled))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, ignore_index, chunk, softcap):
        loss, grad_h, grad_w = _forward(h, weight, targets, ignore_index, chunk, softcap,
                                        need_grads=True)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (h.dtype, weight.dtype)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        # The saved gradients are ours alone (computed in forward): scale them in place.
        grad_h = grad_h.mul_(grad_loss).to(h_dtype) if ctx.needs_input_grad[0] else None
        grad_w = grad_w.mul_(grad_loss).to(w_dtype) if ctx.needs_input_grad[1] else None
        return grad_h, grad_w, None, None, None, None


class ChunkedNextTokenLoss(NextTokenLoss):
    """``minigpt.model.NextTokenLoss`` through ``linear_cross_entropy``: the same value and
    gradients, without the (B, T, V) logits. A bias on the head (GPT-2 has none) or fp16 autocast
    (whose loss scale arrives too late for these fp16 gradient terms) take the plain path."""

    def forward(self, hidden: Tensor, head: nn.Linear, targets: Tensor,
                ignore_index: int = -100) -> Tensor:
        fp16 = torch.is_autocast_enabled(hidden.device.type) and \
            torch.get_autocast_dtype(hidden.device.type) == torch.float16
        if head.bias is not None or fp16:
            return super().forward(hidden, head, targets, ignore_index)
        return linear_cross_entropy(hidden.flatten(0, 1), head.weight, targets.flatten(),
                                    ignore_index=ignore_index, softcap=self.logit_softcap)

