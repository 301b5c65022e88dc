"""The cluster file's models, instances and presets."""

from __future__ import annotations

import re
from typing import Literal

import msgspec

from shared.config.sections import Cpus, EngineKind, PolicyName, TokenMode
from shared.sampling import InvalidParam, SamplingParams
from shared.scheduling.scheduler import SchedulerConfig


def fp16_weights_refusal(dtype: str, device: str) -> str | None:
    """Why weight_dtype = "float16" (fp16 weights, fp32 arithmetic) cannot run with
    this compute dtype on this device, or None. The one rule for the cluster file
    (where dtype may still be "auto") and the engine (resolved); the engine also
    checks that fbgemm runs here, which needs torch."""
    if dtype in ("float32", "auto") and device == "cpu":
        return None
    return (
        "weight_dtype = 'float16' (fp16 weights, fp32 arithmetic) needs dtype float32 "
        f"on the CPU, got dtype {dtype!r} on {device!r}"
    )


# torch's device strings, without importing torch here (the gateway loads no model)
_DEVICE = re.compile(r"(cpu|cuda|mps|xpu|meta)(:\d+)?")
# [models.X.sim]: the sim engine's settings other than the instance's limits
# (services/worker/engine/sim.py SimEngineConfig; a test keeps the two in step)
SIM_SETTINGS = frozenset(
    {
        "num_batch_samples",
        "clock",
        "start_time_s",
        "vocab_size",
        "eos_token_id",
        "first_token_id",
        "output_len_dist",
        "output_len_mean",
        "output_len_sigma",
    }
)


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    engine: EngineKind = "torch"  # torch: real forward | sim: scheduler + batch-time model
    # auto: bf16 where the device computes it natively (AVX-512 BF16, AMX, CUDA),
    # else fp32; services/worker/engine/config.py resolve_dtype
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # How linear weights are stored. auto: fp16 (fp32 arithmetic on fp16 weights, half
    # the bytes a step) where dtype resolves to fp32 on an x86 CPU, else as dtype;
    # same: as dtype; float16: always (fp32 on the CPU only). resolve_weight_dtype
    weight_dtype: Literal["auto", "same", "float16"] = "auto"
    device: str = "cpu"  # torch device
    tokenizer: str | None = None  # tokenizer name; default: the model's own
    price_input_per_mtok: float = 0.0  # cost units per million prompt tokens
    price_output_per_mtok: float = 0.0  # cost units per million output tokens
    batch_time_features: str = ""  # feature set of batch_time_coefs (required by engine = "sim")
    batch_time_coefs: list[float] = []  # seconds per feature unit
    quality: dict[
        str, float
    ] = {}  # judged quality per task name, in [0, 1]; "default" for any task
    sim: dict[str, str | float | int] = {}  # SimEngineConfig fields other than the limits
    # Sampling for requests that send no temperature / top_p: the model card's
    # recommendation, as vLLM and SGLang take a model's generation_config.json (unset:
    # OpenAI's 1.0). A small model sampled at 1.0 often answers nonsense.
    default_temperature: float | None = None
    default_top_p: float | None = None

    def __post_init__(self) -> None:
        # What every worker would refuse at start: said when the file is read, once.
        if not _DEVICE.fullmatch(self.device):
            raise ValueError(
                f"device {self.device!r} is not a torch device: use cpu, cuda or cuda:N"
            )
        if unknown := sorted(set(self.sim) - SIM_SETTINGS):
            raise ValueError(
                f"unknown [sim] setting {', '.join(map(repr, unknown))}: use "
                f"{', '.join(sorted(SIM_SETTINGS))} (the limits come from [instances.scheduler])"
            )
        if self.weight_dtype == "float16" and (
            why := fp16_weights_refusal(self.dtype, self.device)
        ):
            raise ValueError(why)
        try:  # the ranges a request's own values must meet
            SamplingParams(
                max_tokens=1,
                temperature=1.0 if self.default_temperature is None else self.default_temperature,
                top_p=1.0 if self.default_top_p is None else self.default_top_p,
            ).validate()
        except InvalidParam as exc:
            raise ValueError(f"default_{exc.param}: {exc}") from None

    def accuracy(self, task: str | None) -> float:
        """Judged quality for `task` (its own entry, else "default", else 0)."""
        if task is not None and task in self.quality:
            return self.quality[task]
        return self.quality.get("default", 0.0)

    def cost(self, num_prompt_tokens: int, num_output_tokens: float) -> float:
        """Price of a request in cost units: tokens times the per-token prices."""
        return (
            num_prompt_tokens * self.price_input_per_mtok
            + num_output_tokens * self.price_output_per_mtok
        ) / 1e6


class InstanceConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: str  # a key of [models]
    replicas: int = 1  # worker processes serving this model
    # the engine's limits ([instances.scheduler]: max_num_seqs, max_num_batched_tokens,
    # block_size, num_kv_blocks, max_model_len, max_chunk_beside_guests)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    threads: int = 1  # torch threads
    seed: int = 0  # engine RNG seed
    # CPU ids each replica's worker process (its torch threads too) runs on; empty: any.
    # A worker beside the gateway on few cores serves faster on a core of its own.
    cpus: Cpus = []


class PresetConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    models: list[str]  # candidate real models
    policy: PolicyName = "shortest-queue"
    description: str = ""
    routebalance_weights: list[float] = []  # (w_quality, w_latency, w_cost) on the simplex
    lambda_: float = msgspec.field(default=0.0, name="lambda")  # utility per cost unit
    delta: float = 0.0  # sfs-lagrangian: utility per second of predicted TTFT
    # Token-level routing (services/worker/routing/): when set, the request enters on
    # models[0] and the policy passes the pen between the preset's models per token.
    token_policy: str | None = None  # r2r | citer | co-llm | r-stitch | me
    mode: TokenMode = "baton"  # runtime variant (baselines for `just bench-token`)
    args: dict[str, float | str] = {}  # policy arguments (thresholds, weights)

    @property
    def is_token_level(self) -> bool:
        return self.token_policy is not None
