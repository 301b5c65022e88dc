"""Linear layers with weights pre-packed in oneDNN's blocked layout (CPU, bf16 and fp32).

`F.linear` on a bf16 CPU tensor hands the weight to oneDNN in PyTorch's plain
layout, and oneDNN reorders it into its blocked layout on every call. For a
135M-parameter model that reorder is paid for every matmul of every step. Packing
each weight once at start-up (what Inductor's CPU "freezing" pass does) keeps the
arithmetic the same (the outputs are bitwise equal to `F.linear`, checked in
tests/engine/test_cpu_kernels.py) and measured here (1 thread, batch 1-16):
1.3-2x faster per matmul, LM head included.

fp32 is packed too, for another reason: `F.linear` in fp32 goes to MKL's sgemm,
which packs the weight panel by panel inside every call; with a few rows per call
(decode) that costs more than the arithmetic. Measured on an AVX-512 CPU without
BF16 (1 thread, 2026-12-01): a 1536x576 weight at 8 rows 366 us plain vs 214 us
packed, the 49152x576 LM head 26.5 ms vs 10.4 ms; a whole SmolLM2 decode step
1.49x faster at batch 8, 1.24x at 16. But a single row is faster through sgemm's
matrix-vector path (129 vs 232 us), so fp32 layers keep their plain weight too and
send one-row inputs there (twice the weight memory). Packed fp32 is *not*
bitwise equal to `F.linear` (oneDNN sums in another order; within 1e-5 relative):
the exactness tests against HF transformers wrap the plain model in the engine
(`LLMEngine(config, model)`; `pack_weights = False` does the same through
`LLMEngine.create`). Neither path makes a row's result independent of the batch:
sgemm itself gave other bits for a row at 1-8 rows than at 16-24 (measured), the
packed kernel the same bits at 2-24 rows.
"""

from __future__ import annotations

import torch
from torch import nn


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this build can pack weights for (device, dtype)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W held in oneDNN's blocked layout.

    `keep_plain` also keeps W as it is, for one-row inputs (fp32: see the module
    docstring); otherwise no plain copy is kept.
    """

    plain_weight: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        batch_hint: int,
        keep_plain: bool = False,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        # batch_hint: the number of rows oneDNN tunes the layout for; any count works.
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer(
            "plain_weight", weight.detach() if keep_plain else None, persistent=False
        )
        self.register_buffer(
            "bias", None if bias is None else bias.detach().clone(), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain_weight is not None and x.numel() == x.shape[-1]:
            return torch.nn.functional.linear(x, self.plain_weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def pack_linears(module: nn.Module, batch_hint: int) -> int:
    """Replace every nn.Linear under `module` by a PackedLinear; returns how many.

    After this the module's state_dict no longer holds those weights: pack only
    models that serve (the engine), never ones that are saved or compared by name.
    """
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            keep_plain = child.weight.dtype == torch.float32
            setattr(module, name, PackedLinear(child.weight, child.bias, batch_hint, keep_plain))
            count += 1
        else:
            count += pack_linears(child, batch_hint)
    return count
