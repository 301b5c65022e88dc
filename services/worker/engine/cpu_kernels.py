"""Linear layers with weights pre-packed in oneDNN's blocked layout (CPU, bf16).

`F.linear` on a bf16 CPU tensor hands the weight to oneDNN in PyTorch's plain
layout, and oneDNN reorders it into its blocked layout on every call. For a
135M-parameter model that reorder is paid for every matmul of every step. Packing
each weight once at start-up (what Inductor's CPU "freezing" pass does) keeps the
arithmetic the same (the outputs are bitwise equal to `F.linear`, checked in
tests/engine/test_cpu_kernels.py) and measured here (1 thread, batch 1-16):
1.3-2x faster per matmul, LM head included.

Only bf16 is packed: in fp32 `F.linear` goes to MKL's sgemm, not oneDNN, and a
packed fp32 weight would change the rounding (fp32 is the exactness reference).
"""

from __future__ import annotations

import torch
from torch import nn


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this build can pack weights for (device, dtype)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W held in oneDNN's blocked layout (no plain copy kept)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        # batch_hint: the number of rows oneDNN tunes the layout for; any count works.
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer(
            "bias", None if bias is None else bias.detach().clone(), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def pack_linears(module: nn.Module, batch_hint: int) -> int:
    """Replace every nn.Linear under `module` by a PackedLinear; returns how many.

    After this the module's state_dict no longer holds those weights: pack only
    models that serve (the engine), never ones that are saved or compared by name.
    """
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias, batch_hint))
            count += 1
        else:
            count += pack_linears(child, batch_hint)
    return count
