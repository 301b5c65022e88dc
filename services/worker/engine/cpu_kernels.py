"""Linear layers with weights packed once at load: oneDNN's blocked layout (CPU
bf16 and fp32) or fbgemm's fp16 layout (fp32 arithmetic on fp16 weights).

`F.linear` on a bf16 CPU tensor hands the weight to oneDNN in PyTorch's plain
layout, and oneDNN reorders it into its blocked layout on every call. For a
135M-parameter model that reorder is paid for every matmul of every step. Packing
each weight once at start-up (what Inductor's CPU "freezing" pass does) keeps the
arithmetic the same (the outputs are bitwise equal to `F.linear`, checked in
tests/services/worker/engine/test_cpu_kernels.py) and measured here (1 thread, batch 1-16):
1.3-2x faster per matmul, LM head included.

fp32 is packed too, for another reason: `F.linear` in fp32 goes to MKL's sgemm,
which packs the weight panel by panel inside every call; with a few rows per call
(decode) that costs more than the arithmetic. Measured on an AVX-512 CPU without
BF16 (1 thread): a 1536x576 weight at 8 rows 366 us plain vs 214 us
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

**fp16 weights, fp32 arithmetic** (`Fp16WeightLinear`, the engine's `weight_dtype =
"float16"`): on a CPU without native bf16 a decode step is bound by reading fp32
weights (SmolLM2: 536 MB a step). fbgemm's fp16 GEMM (the kernel behind PyTorch's
dynamic fp16 quantization) keeps each weight as fp16, half the bytes, and converts it
to fp32 in registers (F16C), so the arithmetic is an fp32 GEMM on fp16-rounded weights
(measured: 4e-7 relative to F.linear on those rounded weights; the rounding itself
moves a product ~2e-4 relative, a tenth of bf16's). Measured on an AVX2 Zen 3
(1 thread, 30 distinct 3072x576 weights so they come from DRAM): 34 vs
11-14 ms at 1 row, 46-49 vs 24-25 ms at 8, 67 vs 29-39 ms at 16, still ahead at 512
rows (796 vs 717 ms); the 49152x576 LM head 25.4 vs 15.0 ms at 8 rows. No plain copy
is kept: fbgemm is faster than sgemm's gemv at one row too.
"""

from __future__ import annotations

import functools

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


@functools.cache
def fp16_weights_supported() -> bool:
    """Whether fbgemm's fp16-weight GEMM runs here (an x86 CPU with AVX2 and F16C;
    the PyTorch build must ship fbgemm). Probed once with a tiny weight."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        packed = torch.ops.quantized.linear_prepack_fp16(torch.zeros(8, 8), None)
        torch.ops.quantized.linear_dynamic_fp16(torch.zeros(2, 8), packed)
    except RuntimeError:
        return False
    return True


class Fp16WeightLinear(nn.Module):
    """y = x @ W.T + b for fp32 x and y, with W held as fp16 in fbgemm's packed
    layout (see the module docstring). CPU only; W is not kept in any other form."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        b = None if bias is None else bias.detach().float().contiguous()
        # A TorchScript object, not a tensor: a plain attribute (serving only, never saved).
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float(), b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] > 0:
            return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)
        # fbgemm takes 2-D inputs with rows only: fold any other shape (a 1-D vector,
        # an empty batch) into rows and back
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:
            return x.new_zeros((*x.shape[:-1], self.out_features))
        out = torch.ops.quantized.linear_dynamic_fp16(rows, self.packed)
        return out.view(*x.shape[:-1], self.out_features)


def pack_linears(module: nn.Module, batch_hint: int, fp16_weights: bool = False) -> int:
    """Replace every nn.Linear under `module` by a PackedLinear (or, with
    `fp16_weights`, an Fp16WeightLinear); returns how many.

    After this the module's state_dict does not hold those weights: pack only
    models that serve (the engine), never ones that are saved or compared by name.
    """
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            packed: nn.Module
            if fp16_weights:
                packed = Fp16WeightLinear(child.weight, child.bias)
            else:
                keep_plain = child.weight.dtype == torch.float32
                packed = PackedLinear(child.weight, child.bias, batch_hint, keep_plain)
            setattr(module, name, packed)
            count += 1
        else:
            count += pack_linears(child, batch_hint, fp16_weights)
    return count
