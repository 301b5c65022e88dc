"""Engine configuration: one frozen object, built once from the cluster file."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from services.worker.engine.cpu_kernels import fp16_weights_supported
from shared.config import Env, fp16_weights_refusal
from shared.scheduling.scheduler import SchedulerConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO = "auto"
# How linear and LM-head weights are stored: "same" as the compute dtype, or "float16"
# (fp32 arithmetic on fp16 weights, CPU; cpu_kernels.Fp16WeightLinear).
WEIGHT_DTYPES = (AUTO, "same", "float16")


def native_bf16(device: str) -> bool:
    """Whether `device` computes bf16 natively: a CUDA GPU that supports it, or a CPU
    with AVX-512 BF16 or AMX. Elsewhere bf16 matmuls are emulated through fp32 and
    lose to fp32 once a batch forms (measured on an AVX-512 CPU without BF16,
    SmolLM2 decode step: batch 1 bf16 0.8x of fp32's time, batch 8 1.13x, batch 16
    1.46x; docs/engine.md)."""
    if device.startswith("cuda"):
        # compute capability 8.0 (Ampere) and newer; is_bf16_supported() also counts
        # emulation and asks the current device, not this one
        return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 0)
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def resolve_dtype(dtype: str, device: str) -> str:
    """`auto` -> bfloat16 where the device computes it natively, else float32 on CPU
    and float16 on a CUDA GPU without bf16; any other name is returned as is."""
    if dtype != AUTO:
        return dtype
    if native_bf16(device):
        return "bfloat16"
    return "float16" if device.startswith("cuda") else "float32"


def resolve_weight_dtype(weight_dtype: str, dtype: str, device: str, pack_weights: bool) -> str:
    """The dtype linear weights are held in, for a resolved compute `dtype`.

    `auto` -> float16 where the model computes in fp32 on a CPU whose fbgemm runs the
    fp16-weight GEMM and weights are packed (an fp32 decode step there is bound by
    reading the weights: half the bytes, ~1.5-2x faster linears, cpu_kernels.py),
    else the compute dtype; `same` -> the compute dtype; `float16` as asked (the
    config checks it can run)."""
    if weight_dtype == "float16":
        return "float16"
    fp32_cpu = dtype == "float32" and device == "cpu" and pack_weights
    if weight_dtype == AUTO and fp32_cpu and fp16_weights_supported():
        return "float16"
    return dtype


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Model, numerics and limits of one engine instance."""

    model: str = "random-tiny"  # a name from shared.model_store or a checkpoint path
    # auto | float32 | bfloat16 (| float16 on CUDA); auto: bf16 where the device
    # computes it natively, else fp32 (resolve_dtype)
    dtype: str = AUTO
    device: str = "cpu"  # cpu | cuda | cuda:N
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)  # the limits
    # torch intra-op threads: pin them; 2 threads next to a busy neighbour run ~30x slower.
    threads: int = 1
    seed: int = 0  # seed of random-weight models
    num_batch_samples: int = 4096  # batch-time samples kept until popped
    # CPU: pre-pack linear weights once (cpu_kernels.py). False serves the plain
    # model (the exactness tests against HF transformers).
    pack_weights: bool = True
    # auto | same | float16: how linear weights are stored (resolve_weight_dtype);
    # float16 = fp32 arithmetic on fp16 weights, CPU with fp32 compute only.
    weight_dtype: str = AUTO

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES and self.dtype != AUTO:
            choices = sorted([*DTYPES, AUTO])
            raise ValueError(f"dtype must be one of {choices}, got {self.dtype!r}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"weight_dtype must be one of {list(WEIGHT_DTYPES)}, got {self.weight_dtype!r}"
            )
        if self.weight_dtype == "float16":
            if why := fp16_weights_refusal(self.resolved_dtype, self.device):
                raise ValueError(why)
            if not self.pack_weights:
                raise ValueError("weight_dtype = 'float16' needs pack_weights = true")
            if not fp16_weights_supported():
                raise ValueError(
                    "weight_dtype = 'float16' needs fbgemm (an x86 CPU with AVX2); "
                    "use 'auto' or 'same'"
                )
        if self.threads < 1:
            raise ValueError("threads must be >= 1")

    @property
    def resolved_dtype(self) -> str:
        """The dtype name the engine runs (`auto` resolved for this device)."""
        return resolve_dtype(self.dtype, self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.resolved_dtype]

    @property
    def resolved_weight_dtype(self) -> str:
        """The dtype the engine holds its linear weights in (`auto` resolved)."""
        return resolve_weight_dtype(
            self.weight_dtype, self.resolved_dtype, self.device, self.pack_weights
        )

    @property
    def fp16_weights(self) -> bool:
        """fp32 arithmetic on fp16 weights (weights stored apart from the compute dtype)."""
        return self.resolved_weight_dtype != self.resolved_dtype

    def with_env(self, environ: Mapping[str, str]) -> EngineConfig:
        """Apply deployment-wide overrides: BATON_DTYPE sets every worker's dtype,
        BATON_WEIGHT_DTYPE its weight storage."""
        dtype = Env.DTYPE.get(environ) or self.dtype
        weight_dtype = Env.WEIGHT_DTYPE.get(environ) or self.weight_dtype
        return dataclasses.replace(self, dtype=dtype, weight_dtype=weight_dtype)
