"""Fast CPU decoding: linear layers with oneDNN-prepacked weights (optionally bfloat16).

Decoding one token at a time multiplies a vector by every weight matrix, so its speed is the
speed of reading the weights from memory. On x86 CPUs oneDNN reads its own blocked weight layout
noticeably faster than the (out, in) layout of ``nn.Linear`` (bench/generate.py measures it),
and bfloat16 weights halve the bytes read. ``pack_linears`` repacks a model's linear layers once
for inference: everything else (embeddings, LayerNorm, attention, the KV cache) is unchanged and
stays in the model's dtype, so bfloat16 here means bfloat16 *weights* with float32 activations.

The packed model is for inference only: it cannot be trained, and its state dict is not the
model's (save the model before packing it).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def can_pack(device: torch.device | str = "cpu") -> bool:
    """Whether this PyTorch build and ``device`` support packed linear layers."""
    return (torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """``nn.Linear`` for inference with a oneDNN-packed weight in ``weight_dtype``; inputs are
    cast to ``weight_dtype`` and outputs back to the input's dtype."""

    def __init__(self, linear: nn.Linear, weight_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_dtype = weight_dtype
        weight = linear.weight.detach().to(weight_dtype)
        self.bias = None if linear.bias is None else linear.bias.detach().to(weight_dtype)
        # A float32 LM head (out >> in) streams faster through MKL's GEMM from an (in, out)
        # copy than through oneDNN's packing (~25% for 50257 x 768 here, bench/generate.py).
        self.use_mkl = weight_dtype == torch.float32 and self.out_features >= 8 * self.in_features
        if self.use_mkl:
            self.packed_weight = weight.t().contiguous()  # (in, out)
        else:  # oneDNN's blocked layout for one row at a time (decoding); any number works
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)

    def forward(self, x: Tensor) -> Tensor:
        if self.use_mkl:
            rows = x.reshape(-1, self.in_features)  # (N, in)
            y = rows @ self.packed_weight if self.bias is None else \
                torch.addmm(self.bias, rows, self.packed_weight)  # (N, out)
            return y.view(*x.shape[:-1], self.out_features)
        y = torch.ops.mkldnn._linear_pointwise(
            x.to(self.weight_dtype), self.packed_weight, self.bias, "none", [], ""
        )
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weight_dtype={self.weight_dtype}")


@torch.no_grad()
def pack_linears(model: nn.Module, weight_dtype: torch.dtype = torch.float32) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (on the CPU) by a ``PackedLinear``, in place, and
    return it in eval mode. A weight tied to an embedding (GPT-2's LM head) is packed as a copy;
    the embedding keeps its own."""
    if not can_pack(next(model.parameters()).device):
        raise ValueError("packed linear layers need a CPU model and PyTorch built with oneDNN")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child, weight_dtype))
    return model.eval()
