"""Fast CPU decoding: linear layers with oneDNN-prepacked weights (optionally bfloat16).

Decoding one token at a time multiplies a vector by every weight matrix, so its speed is the
speed of reading the weights from memory. On x86 CPUs oneDNN reads its own blocked weight layout
faster than the (out, in) layout of ``nn.Linear`` (``bench/generate.py`` measures it), and
bfloat16 weights halve the bytes read. ``PackedLinear.like(layer)`` keeps ``layer``'s
``Parameter`` objects (so the state dict and tied weights are unchanged) and multiplies with a
packed copy made once: for inference only, since the copy does not follow later weight updates.
Everything else (embeddings, LayerNorm, attention, the KV cache) stays in the model's dtype, so
bfloat16 here means bfloat16 *weights* with float32 activations.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class PackedLinear(nn.Module):
    """``nn.Linear`` for inference, multiplying with a oneDNN-packed copy of its weight in
    ``weight_dtype``; inputs are cast to ``weight_dtype`` and outputs back to the input's dtype."""

    def __init__(self, in_features: int, out_features: int, weight: nn.Parameter,
                 bias: nn.Parameter | None, weight_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight, self.bias = weight, bias  # the original Parameters: the state dict's keys
        self.weight_dtype = weight_dtype
        with torch.no_grad():
            packed = weight.detach().to(weight_dtype)
            self._bias = None if bias is None else bias.detach().to(weight_dtype)
            # A float32 LM head (out >> in) streams faster through MKL's GEMM from an (in, out)
            # copy than through oneDNN's packing (bench/generate.py).
            self.use_mkl = weight_dtype == torch.float32 and out_features >= 8 * in_features
            if self.use_mkl:
                self._packed = packed.t().contiguous()  # (in, out)
            else:  # oneDNN's blocked layout for one row at a time (decoding); any number works
                self._packed = torch.ops.mkldnn._reorder_linear_weight(packed, 1)

    @classmethod
    def like(cls, layer: nn.Linear, weight_dtype: torch.dtype = torch.float32) -> PackedLinear:
        return cls(layer.in_features, layer.out_features, layer.weight, layer.bias, weight_dtype)

    def forward(self, x: Tensor) -> Tensor:
        if self.use_mkl:
            rows = x.reshape(-1, self.in_features)  # (N, in)
            y = rows @ self._packed if self._bias is None else \
                torch.addmm(self._bias, rows, self._packed)  # (N, out)
            return y.view(*x.shape[:-1], self.out_features)
        y = torch.ops.mkldnn._linear_pointwise(
            x.to(self.weight_dtype), self._packed, self._bias, "none", [], ""
        )
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weight_dtype={self.weight_dtype}")
