"""Cluster file (TOML) -> frozen config objects, and the BATON_* environment registry.

The cluster file names the models, the instances that serve them, the routing
presets and the per-service settings. Environment variables override a few
deployment-level values; they are read when a service starts (`load_cluster`),
never at import time.

    namespace = "baton"
    nats_url = "nats://127.0.0.1:4222"
    redis_url = "redis://127.0.0.1:6379/0"
    [gateway]    host, port, max_in_flight, ...
    [estimator]  policy, snapshot_max_age_s, ...
    [worker]     heartbeat_interval_s, heartbeat_ttl_s, drain_timeout_s, ...
    [batcher]    hold_timeout_ms, publish_interval_s, max_n, min_*, half_life_s, fixed_b,
                 max_compute_share
    [models.<name>]     engine, dtype, weight_dtype, device, tokenizer, price_*_per_mtok
    [[instances]]       model, replicas, max_num_seqs, max_model_len, ...
    [presets.<name>]    models, policy

Every service section ([gateway], [estimator], [batcher], [relay]) and every
[[instances]] entry takes `cpus`, the CPU ids its processes may run on (empty: any),
and the top-level `server_cpus` those of the NATS and Redis servers the launcher
starts (shared.runtime.pin_cpus says why and what was measured).
"""

from __future__ import annotations

import logging
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlparse

import msgspec

from shared import subjects
from shared.sampling import InvalidParam, SamplingParams
from shared.scheduling.scheduler import SchedulerConfig

DEFAULT_CLUSTER_FILE = "configs/local.toml"

# Query-level policies a cluster file (or a request's x-baton-policy header) may name.
# The estimator implements all but routebalance: a cluster file naming it is refused
# (ClusterConfig.check) until it lands.
PolicyName = Literal[
    "round-robin",
    "shortest-queue",
    "latency-agnostic",
    "sfs-constraint",
    "sfs-lagrangian",
    "routebalance",
]
# What the estimator runs today (a request's x-baton-policy must name one of these).
IMPLEMENTED_POLICIES: tuple[str, ...] = (
    "round-robin",
    "shortest-queue",
    "latency-agnostic",
    "sfs-constraint",
    "sfs-lagrangian",
)
EngineKind = Literal["torch", "sim"]
# Token-level policies a preset's token_policy may name: the keys of the worker's
# TOKEN_POLICIES (services/worker/routing/policies/, which checks the two agree when
# imported). Checked when the file is read, so a misspelt name stops the launch
# instead of failing every request of the preset.
TOKEN_POLICY_NAMES: set[str] = {"r2r", "citer", "co-llm", "r-stitch", "me"}
# How a token-level preset runs (docs/token-routing.md): baton = async per-model
# loops, pending resume and delayed batching; eager_async = the same without
# delayed batching; barrier = step barriers (the entry model waits while any of
# its requests is at a peer, as lockstep serving does); std_serving = no pending
# resume (every hand-over is a new request on the receiver, the sender frees its KV).
TokenMode = Literal["baton", "eager_async", "barrier", "std_serving"]
# CPU ids a process may run on (os.sched_setaffinity); an empty list: any CPU.
Cpus = list[Annotated[int, msgspec.Meta(ge=0)]]
# The services whose own section takes `cpus` (ClusterConfig.service_cpus); workers
# take theirs from their [[instances]] entry.
SERVICES_WITH_CPUS = ("gateway", "estimator", "batcher", "relay")


class ConfigError(ValueError):
    """The cluster file or an environment variable is invalid."""


# the schemes the clients take (nats-py; redis-py: unix:// is a socket path)
_URL_SCHEMES = {"nats_url": ("nats", "tls", "ws", "wss"), "redis_url": ("redis", "rediss", "unix")}


def url_refusal(key: str, url: str) -> str | None:
    """Why `url` cannot be the cluster's `key` (nats_url or redis_url), or None."""
    schemes = _URL_SCHEMES[key]
    try:
        parsed = urlparse(url)
        parsed.port  # noqa: B018  (a port that is no number fails only when read)
    except ValueError as exc:
        return str(exc)
    if parsed.scheme not in schemes:
        return f"use a URL with the scheme {' or '.join(s + '://' for s in schemes)}"
    if parsed.scheme == "unix":  # (redis-py would drop a host part and read the rest)
        if parsed.hostname or not parsed.path.startswith("/"):
            return "a unix:// URL names a socket by its absolute path (unix:///path/to/sock)"
    elif not parsed.hostname:
        return f"no host in it (e.g. {schemes[0]}://127.0.0.1)"
    return None


def shown_url(url: str) -> str:
    """`url` for a message: a password in it written as ***."""
    parsed = urlparse(url)
    if parsed.password is None:
        return url
    return parsed._replace(
        netloc=parsed.netloc.replace(f":{parsed.password}@", ":***@", 1)
    ).geturl()


def require_token(value: str, what: str, why: str) -> str:
    """`value` if it can be one NATS subject token (and Redis key part), else a
    ConfigError naming `what` it is and `why` it must be one."""
    if not subjects.is_token(value):
        raise ConfigError(f"{what} {value!r} may hold only letters, digits, '_' and '-' ({why})")
    return value


# ---------------------------------------------------------------------------
# Environment registry


@dataclass(frozen=True)
class EnvVar:
    """One BATON_* variable: its name, what it does, and how to read it."""

    name: str
    help: str

    def get(self, environ: Mapping[str, str] | None = None) -> str | None:
        value = (os.environ if environ is None else environ).get(self.name)
        return value if value else None

    def get_int(self, environ: Mapping[str, str] | None = None) -> int | None:
        value = self.get(environ)
        if value is None:
            return None
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{self.name} must be an integer, got {value!r}") from None


class Env:
    """Every environment variable Baton reads. Nothing else calls os.environ for config."""

    CLUSTER = EnvVar("BATON_CLUSTER", "cluster file path (default configs/local.toml)")
    NAMESPACE = EnvVar("BATON_NAMESPACE", "prefix of every NATS subject and Redis key")
    NATS_URL = EnvVar("BATON_NATS_URL", "NATS server URL")
    REDIS_URL = EnvVar("BATON_REDIS_URL", "Redis URL")
    HOST = EnvVar("BATON_HOST", "gateway bind address")
    PORT = EnvVar("BATON_PORT", "gateway HTTP port")
    DTYPE = EnvVar("BATON_DTYPE", "engine dtype for every model: auto | float32 | bfloat16")
    WEIGHT_DTYPE = EnvVar(
        "BATON_WEIGHT_DTYPE", "how every model stores its linear weights: auto | same | float16"
    )
    DEVICE = EnvVar("BATON_DEVICE", "engine device for every model: cpu | cuda")
    THREADS = EnvVar("BATON_THREADS", "torch threads per worker process")
    INSTANCE_ID = EnvVar("BATON_INSTANCE_ID", "worker instance id (default: model-host-pid)")
    LINK_HOST = EnvVar(
        "BATON_LINK_HOST", "where a worker's direct link listens ([worker] link_host; 0.0.0.0: all)"
    )
    MODEL = EnvVar("BATON_MODEL", "model a worker serves (when not given on the command line)")
    GATEWAY_ID = EnvVar("BATON_GATEWAY_ID", "gateway id (default: gw-host-pid)")
    API_KEY = EnvVar(
        "BATON_API_KEY", "gateway: require this bearer token on /v1/* (adds to [gateway] api_keys)"
    )
    LOG_LEVEL = EnvVar("BATON_LOG_LEVEL", "debug | info | warning | error")
    LOG_DIR = EnvVar("BATON_LOG_DIR", "launcher: where per-service logs go (default logs/)")
    CACHE_DIR = EnvVar(
        "BATON_CACHE_DIR",
        "derived artefacts: tokenizers, converted weights, native builds, under DIR/baton/ "
        "(default .cache/)",
    )
    NATIVE = EnvVar(
        "BATON_NATIVE", "0: run the SFS replay kernel as plain Python, not its mypyc build"
    )
    DATA_DIR = EnvVar(
        "BATON_DATA_DIR", "traces and prompt sets of loadgen and the benchmarks (default data/)"
    )

    @classmethod
    def all(cls) -> list[EnvVar]:
        return [v for v in vars(cls).values() if isinstance(v, EnvVar)]


# ---------------------------------------------------------------------------
# Cluster file schema (msgspec validates types and rejects unknown keys)


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class GatewayConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"  # bind address
    port: int = 8000  # HTTP port
    max_in_flight: int = 256  # requests admitted at once; past it: 429
    route_timeout_s: float = 2.0  # seconds to wait for the estimator
    route_single_locally: bool = True  # skip the estimator when one live instance serves the model
    # seconds without any event from the worker before a request fails
    event_timeout_s: float = 300.0
    retry_after_s: int = 1  # seconds, the Retry-After header on 429/503
    registry_refresh_s: float = 0.5  # seconds between reads of the worker registry
    default_completion_max_tokens: int = 16  # /v1/completions default (OpenAI's)
    max_request_bytes: int = 4_000_000  # bytes of JSON body at most
    api_keys: list[str] = []  # when set, /v1/* requires "Authorization: Bearer <one of them>"
    # Seconds an idle client connection stays open. Longer than clients keep theirs idle
    # (httpx and the openai SDK 5 s, aiohttp 15 s; a load balancer often 60 s): a server
    # that closes first races the client's reuse, and that request fails with a reset.
    keep_alive_s: int = 75
    # Origins whose browser pages may call the API (CORS: preflights answered, responses
    # carrying Access-Control-Allow-Origin); ["*"]: any page. Empty (the default): no
    # CORS, as a page on any site could otherwise spend a local server's models.
    cors_allow_origins: list[str] = []
    cpus: Cpus = []  # CPU ids the gateway process runs on (empty: any)


class EstimatorConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    policy: PolicyName = "shortest-queue"  # for requests that name a real model
    snapshot_max_age_s: float = 5.0  # seconds; an older snapshot is stale
    ledger_ttl_s: float = 60.0  # seconds a ledger entry lives without being reconciled
    # Share the ledger with the other estimator replicas through Redis (no herding when
    # several replicas route one burst); false: each replica knows only its own decisions.
    shared_ledger: bool = True
    registry_refresh_s: float = 0.5  # seconds between reads of the worker registry
    # Default TTFT target of a request that names none (SFS: tau = base + per_token * P,
    # clipped); read by the latency-aware policies.
    ttft_slo_base_ms: float = 158.0  # ms
    ttft_slo_per_prompt_token_ms: float = 3.5e-3  # ms per prompt token
    ttft_slo_min_ms: float = 150.0  # ms
    ttft_slo_max_ms: float = 1120.0  # ms
    # Weights of the utility policies for requests naming a real model (presets set
    # their own): U = acc - lambda * cost; Lagrangian score U - delta * TTFT_s.
    lambda_: float = msgspec.field(default=0.0, name="lambda")  # utility per cost unit
    delta: float = 0.0  # utility per second of predicted TTFT
    snapshot_refresh_s: float = 0.02  # seconds between background reads of every snapshot
    fit_interval_s: float = 1.0  # seconds between reads of new batch samples (and refits)
    fit_refit_every: int = 256  # new samples per instance before a refit
    fit_min_samples: int = 64  # samples before the first fit of an instance
    default_output_tokens: int = 128  # predicted output of a request without a prediction
    # Directory of the output-length and quality predictors (docs/predictors.md), relative
    # to the repository root; "" disables them (quality table and default length only).
    predictors: str = "models/predictors"
    arrival_window_s: float = 1.0  # LPS fallback: EWMA window of the per-instance arrival rate
    # Correct each instance's SFS estimate by the measured TTFTs the gateway reports
    # (sfs/correction.py): weight of each new one, 0 turns the correction off.
    ttft_correction_alpha: float = 0.05
    # A snapshot's batch_time_speed (how fast its latest iterations ran against its
    # calibration) scales an SFS TTFT estimate T by speed ** exp(-T / this): the recent
    # speed says much about the next few iterations, little about those a second away
    # (docs/sfs.md, "Recent speed"); 0: the estimate is not scaled (the snapshot's age
    # is still read at that speed; [worker] batch_time_speed_alpha = 0 turns it off).
    speed_horizon_s: float = 0.3
    cpus: Cpus = []  # CPU ids the estimator process runs on (empty: any)


class WorkerConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    heartbeat_interval_s: float = 1.0  # seconds between registrations
    heartbeat_ttl_s: float = 3.0  # seconds a registration lives without renewal
    drain_timeout_s: float = 10.0  # seconds SIGTERM waits for in-flight requests
    snapshot_ttl_s: float = 30.0  # seconds a snapshot key lives without being rewritten
    max_batch_samples: int = 10_000  # samples kept per instance in Redis
    # At most one snapshot write per this many ms: iterations that end sooner are folded
    # into the next write, which always carries the newest state (readers refresh every
    # 20 ms); 0: a write after every iteration, one in flight at a time.
    snapshot_interval_ms: float = 5.0
    # ... and at most one per this many ms while only progress changes (the same
    # requests, each further along): the estimator replays a snapshot forward by its age
    # with the batch-time model, so such a snapshot ages without misleading it, while a
    # request that arrives, finishes or changes queue is written within
    # snapshot_interval_ms. Below snapshot_interval_ms it is that; with
    # snapshot_interval_ms = 0 every iteration is written.
    snapshot_progress_interval_ms: float = 20.0
    # A step runs on the event loop (not in a thread) when it admits at most this many
    # prompt tokens and is the first after an idle wait (the TTFT path skips two thread
    # hand-offs) or follows a step of at most max_inline_step_ms; 0: always a thread.
    max_inline_step_tokens: int = 256
    max_inline_step_ms: float = 20.0  # 0: only the first step after an idle wait
    # A step's tokens for a gateway wait for the next step's write while that step is
    # expected to end within this many ms of the oldest token held (a fast model's
    # tokens go out every few steps, in one write and one SSE chunk per stream); a
    # request's first and last tokens and failures never wait. 0: a write every step.
    stream_interval_ms: float = 5.0
    # Weight of the newest iteration in the snapshot's batch_time_speed (measured /
    # modeled batch time lately, shared/scheduling/speed.py); 0: always 1.
    batch_time_speed_alpha: float = 0.2
    # Gateways send a worker its requests, and take their tokens back, over one direct
    # TCP link per worker (shared/link.py: one hop, no NATS server between); false:
    # everything over NATS. A request goes over NATS whenever its worker's link is down.
    link: bool = True
    link_host: str = "127.0.0.1"  # where a worker's link listens ("0.0.0.0": everywhere)
    link_port: int = 0  # 0: a free port (each worker of a host its own)
    # the host gateways dial; "": link_host, or this host's address when that is 0.0.0.0
    link_advertise_host: str = ""
    # The same link also listens on an abstract Unix socket (Linux), which a gateway on
    # the same host dials instead of the TCP port: a write there costs the sender about
    # half a loopback TCP write
    link_unix: bool = True


class BatcherConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    hold_timeout_ms: float = 20.0  # ms an idle model holds its oldest ready request at most
    publish_interval_s: float = 5.0  # seconds between recomputes and publications of the tables
    max_n: int = 16  # tables cover concurrency N = 1..max_n (workers clamp larger N)
    min_tokens: int = 2000  # entry-model tokens (decayed) before p is trusted
    min_handoffs: int = 20  # hand-offs each way (decayed) before p and tokens/visit are trusted
    min_step_samples: int = 50  # step samples per model (decayed) before its latency fit is used
    half_life_s: float = 60.0  # seconds; older statistics weigh half as much per half life
    # recompute only when p, tokens/visit or a fitted step time moved by this fraction
    recompute_rel_change: float = 0.05
    nice: int = 10  # the batcher process's CPU niceness (its chain must not slow the workers)
    # The chain's recomputes take at most this share of one core over time: after one
    # that took t seconds the next waits t / share (a table for N = 1..16 costs ~3 s).
    max_compute_share: float = 0.1
    # Experiments: publish this (B_entry, B_large) for every N instead of the chain's
    # choice (clamped to the deadlock bound per N); empty = the chain decides.
    fixed_b: list[int] = []
    cpus: Cpus = []  # CPU ids the batcher process runs on (empty: any)


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


class ModelConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
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
                f"{', '.join(sorted(SIM_SETTINGS))} (the limits come from [[instances]])"
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


class InstanceConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
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


class PresetConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
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


class RelayConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # A peer that holds the pen this long without answering is given up on: the
    # origin gets the request back and finishes it alone.
    peer_timeout_s: float = 10.0
    # Safety nets on the workers for a relay that is itself gone (it answers nothing):
    # an origin whose request has been away this long asks the relay about it and,
    # unless the relay still times that hand-off, takes it back and finishes alone
    # (keep it above peer_timeout_s, which normally decides first) ...
    origin_wait_s: float = 30.0
    # ... and a peer's copy that no visit has touched this long is dropped (a later
    # visit fails back to the origin, which then finishes alone).
    guest_idle_s: float = 300.0
    registry_refresh_s: float = 0.5  # how often the relay re-reads live workers and loads
    stats_interval_s: float = 1.0  # workers send RoutingStats to the batcher this often
    cpus: Cpus = []  # CPU ids the relay process runs on (empty: any)


class ClusterConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One deployment: everything every service needs, built once at start."""

    namespace: str = "baton"
    nats_url: str = "nats://127.0.0.1:4222"
    redis_url: str = "redis://127.0.0.1:6379/0"
    server_cpus: Cpus = []  # CPU ids of the NATS and Redis servers the launcher starts
    gateway: GatewayConfig = GatewayConfig()
    estimator: EstimatorConfig = EstimatorConfig()
    worker: WorkerConfig = WorkerConfig()
    batcher: BatcherConfig = BatcherConfig()
    relay: RelayConfig = RelayConfig()
    models: dict[str, ModelConfig] = {}
    instances: list[InstanceConfig] = []
    presets: dict[str, PresetConfig] = {}

    def instance_for(self, model: str) -> InstanceConfig:
        for inst in self.instances:
            if inst.model == model:
                return inst
        raise ConfigError(f"no [[instances]] entry serves model {model!r}")

    def tokenizer_for(self, model: str) -> str:
        """Tokenizer name for a real model or a preset (a preset uses its first model's)."""
        if model in self.presets:
            model = self.presets[model].models[0]
        return self.models[model].tokenizer or model

    def candidates(self, model: str) -> list[str]:
        """Real models that may serve a request for `model` (a real model or a preset)."""
        if model in self.presets:
            preset = self.presets[model]
            # A token-level request always enters on the preset's first model.
            return [preset.models[0]] if preset.is_token_level else list(preset.models)
        return [model] if model in self.models else []

    def sampling_defaults(self, model: str) -> tuple[float, float]:
        """(temperature, top_p) for a request to `model` that sends neither: the model's
        defaults, OpenAI's 1.0 where unset. A preset's request is checked with its first
        model's; once routing has picked the model that answers, the gateway takes that
        one's (completions.routed_defaults)."""
        entry = self.models.get(self.presets[model].models[0] if model in self.presets else model)
        if entry is None:
            return 1.0, 1.0
        return (
            1.0 if entry.default_temperature is None else entry.default_temperature,
            1.0 if entry.default_top_p is None else entry.default_top_p,
        )

    def service_cpus(self, service: str) -> list[int]:
        """`cpus` of a service's own section (one of SERVICES_WITH_CPUS)."""
        if service not in SERVICES_WITH_CPUS:
            raise KeyError(f"[{service}] takes no cpus")
        section: GatewayConfig | EstimatorConfig | BatcherConfig | RelayConfig
        section = getattr(self, service)
        return section.cpus

    def cpu_settings(self) -> list[tuple[str, list[int]]]:
        """(where, cpus) of every process the cluster file pins, for one check up front."""
        sections = [("server_cpus", self.server_cpus)]
        sections += [(f"[{s}]", self.service_cpus(s)) for s in SERVICES_WITH_CPUS]
        sections += [(f"[[instances]] of {i.model!r}", i.cpus) for i in self.instances]
        return [(where, cpus) for where, cpus in sections if cpus]

    def token_presets(self) -> dict[str, PresetConfig]:
        """The presets that route per token."""
        return {n: p for n, p in self.presets.items() if p.is_token_level}

    def replica_ids(self, inst: InstanceConfig) -> list[str]:
        """Instance ids of the launcher's workers for one [[instances]] entry: model-i,
        made a subject token (a model named "qwen2.5-7b" runs as "qwen2-5-7b-0", ...)."""
        return [subjects.as_token(f"{inst.model}-{i}") for i in range(inst.replicas)]

    def check(self) -> None:
        """Cross-field checks msgspec cannot express."""
        require_token(self.namespace, "namespace", "it starts every NATS subject and Redis key")
        for name in self.token_presets():
            require_token(name, "token-level preset", "it names the batcher's tables in Redis")
        policies = [("[estimator]", self.estimator.policy)]
        policies += [(f"[presets.{name}]", p.policy) for name, p in self.presets.items()]
        for where, policy in policies:
            if policy not in IMPLEMENTED_POLICIES:
                raise ConfigError(
                    f"{where} policy {policy!r} is not available in this estimator yet: "
                    f"use one of {', '.join(IMPLEMENTED_POLICIES)}"
                )
        for name, model in self.models.items():
            if model.engine == "sim" and not (model.batch_time_features and model.batch_time_coefs):
                raise ConfigError(
                    f'model {name!r}: engine = "sim" needs batch_time_features and batch_time_coefs'
                )
        for inst in self.instances:
            if inst.model not in self.models:
                raise ConfigError(f"instance serves unknown model {inst.model!r}")
            if inst.replicas < 0:
                raise ConfigError(f"replicas must be >= 0 for {inst.model!r}")
            if inst.threads < 1:
                raise ConfigError(f"threads must be >= 1 for {inst.model!r}")
            if inst.cpus and inst.threads > len(set(inst.cpus)):
                # torch's OpenMP threads on fewer cores than threads wait on each other
                # (measured here: ~30x slower steps with a busy neighbour)
                raise ConfigError(
                    f"[[instances]] of {inst.model!r}: threads = {inst.threads} but cpus "
                    f"{inst.cpus} gives it {len(set(inst.cpus))}: use at most one thread per CPU"
                )
        owner: dict[str, str] = {}  # instance id -> the model whose replica it is
        for inst in self.instances:
            for iid in self.replica_ids(inst):
                if iid in owner:
                    raise ConfigError(
                        f"[[instances]] of {owner[iid]!r} and {inst.model!r} give two replicas "
                        f"the instance id {iid!r} (ids keep letters, digits, '_' and '-'): "
                        "rename a model, or list each model in one entry"
                    )
                owner[iid] = inst.model
        for name, preset in self.presets.items():
            if name in self.models:
                raise ConfigError(f"preset {name!r} has the name of a real model")
            if not preset.models:
                raise ConfigError(f"preset {name!r} names no models")
            for m in preset.models:
                if m not in self.models:
                    raise ConfigError(f"preset {name!r} names unknown model {m!r}")
        for name, preset in self.presets.items():
            if preset.token_policy is not None and preset.token_policy not in TOKEN_POLICY_NAMES:
                raise ConfigError(
                    f"preset {name!r}: unknown token_policy {preset.token_policy!r}: use one "
                    f"of {', '.join(sorted(TOKEN_POLICY_NAMES))}"
                )
            if preset.lambda_ < 0 or preset.delta < 0:
                raise ConfigError(f"preset {name!r}: lambda and delta must be >= 0")
        if not self.gateway.event_timeout_s > 0:
            raise ConfigError("[gateway] event_timeout_s must be > 0")
        if not self.gateway.keep_alive_s > 0:
            raise ConfigError("[gateway] keep_alive_s must be > 0")
        if self.worker.max_inline_step_tokens < 0:
            raise ConfigError("[worker] max_inline_step_tokens must be >= 0")
        if not self.worker.max_inline_step_ms >= 0:
            raise ConfigError("[worker] max_inline_step_ms must be >= 0")
        if not 0 <= self.worker.stream_interval_ms <= 1000:
            raise ConfigError("[worker] stream_interval_ms must be in [0, 1000]")
        if self.worker.stream_interval_ms / 1000 >= self.gateway.event_timeout_s:
            raise ConfigError(
                "[worker] stream_interval_ms must be shorter than [gateway] event_timeout_s "
                "(a stream silent that long is failed)"
            )
        if not 0 <= self.worker.snapshot_interval_ms <= 1000:
            raise ConfigError("[worker] snapshot_interval_ms must be in [0, 1000]")
        if not 0.0 <= self.worker.batch_time_speed_alpha <= 1.0:
            raise ConfigError("[worker] batch_time_speed_alpha must be in [0, 1]")
        if self.estimator.lambda_ < 0 or self.estimator.delta < 0:
            raise ConfigError("[estimator] lambda and delta must be >= 0")
        if not self.estimator.speed_horizon_s >= 0:
            raise ConfigError("[estimator] speed_horizon_s must be >= 0")
        b = self.batcher
        if not 1 <= b.max_n <= 20:  # a table costs ~N^5 (16: ~3 s on one core, 20: ~11 s)
            raise ConfigError(f"[batcher] max_n must be in 1..20, got {b.max_n}")
        if b.fixed_b and (len(b.fixed_b) != 2 or min(b.fixed_b) < 1):
            raise ConfigError(f"[batcher] fixed_b must be two values >= 1, got {b.fixed_b}")
        if not 0 < b.max_compute_share <= 1:
            raise ConfigError(
                f"[batcher] max_compute_share must be in (0, 1], got {b.max_compute_share}"
            )
        if b.hold_timeout_ms <= 0 or b.publish_interval_s <= 0 or b.half_life_s <= 0:
            raise ConfigError(
                "[batcher] hold_timeout_ms, publish_interval_s, half_life_s must be > 0"
            )
        r = self.relay
        if r.peer_timeout_s <= 0 or r.origin_wait_s <= r.peer_timeout_s:
            raise ConfigError(
                "[relay] peer_timeout_s must be > 0 and origin_wait_s above it "
                f"(got {r.peer_timeout_s} and {r.origin_wait_s})"
            )
        if r.guest_idle_s <= 0:
            raise ConfigError(f"[relay] guest_idle_s must be > 0, got {r.guest_idle_s}")
        self._check_limits()
        for key, url in (("nats_url", self.nats_url), ("redis_url", self.redis_url)):
            if why := url_refusal(key, url):
                raise ConfigError(f"{key} {shown_url(url)!r}: {why}")
        if not 0 < self.gateway.port < 65536:
            raise ConfigError(f"gateway port out of range: {self.gateway.port}")
        if not 0 <= self.worker.link_port < 65536:
            raise ConfigError(
                f"[worker] link_port out of range (0: a free port): {self.worker.link_port}"
            )

    def _check_limits(self) -> None:
        """Counts and durations that only make sense in a range: out of it, a cluster
        started and then failed every request (max_in_flight 0: a 429 for each), flapped
        (a registration that expires before its renewal) or spun (a heartbeat every
        0 s); said when the file is read instead."""
        g, e, w = self.gateway, self.estimator, self.worker
        positive = {
            "[gateway] max_in_flight": g.max_in_flight,
            "[gateway] route_timeout_s": g.route_timeout_s,
            "[gateway] registry_refresh_s": g.registry_refresh_s,
            "[gateway] default_completion_max_tokens": g.default_completion_max_tokens,
            "[gateway] max_request_bytes": g.max_request_bytes,
            "[estimator] snapshot_max_age_s": e.snapshot_max_age_s,
            "[estimator] ledger_ttl_s": e.ledger_ttl_s,
            "[estimator] registry_refresh_s": e.registry_refresh_s,
            "[estimator] snapshot_refresh_s": e.snapshot_refresh_s,
            "[estimator] fit_interval_s": e.fit_interval_s,
            "[worker] heartbeat_interval_s": w.heartbeat_interval_s,
            "[worker] snapshot_ttl_s": w.snapshot_ttl_s,
            "[worker] max_batch_samples": w.max_batch_samples,
        }
        for name, value in positive.items():
            if not value > 0:  # (not <= 0: NaN fails too)
                raise ConfigError(f"{name} must be > 0, got {value}")
        if not (g.retry_after_s >= 0 and w.drain_timeout_s >= 0):
            raise ConfigError("[gateway] retry_after_s and [worker] drain_timeout_s must be >= 0")
        if not w.heartbeat_ttl_s > w.heartbeat_interval_s:
            raise ConfigError(
                f"[worker] heartbeat_ttl_s ({w.heartbeat_ttl_s}) must be longer than "
                f"heartbeat_interval_s ({w.heartbeat_interval_s}): a registration would "
                "expire before its renewal, and the workers would come and go"
            )
        for name, model in self.models.items():
            if not (model.price_input_per_mtok >= 0 and model.price_output_per_mtok >= 0):
                raise ConfigError(f"model {name!r}: prices must be >= 0")


def parse_cluster(text: str, environ: Mapping[str, str] | None = None) -> ClusterConfig:
    """Parse cluster-file TOML, apply BATON_* overrides, check it."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"cluster file is not valid TOML: {exc}") from None
    _apply_env(raw, environ)
    try:
        try:
            cfg = msgspec.convert(raw, ClusterConfig)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"cluster file: {_located(raw, exc)}") from None
        cfg.check()
    except ConfigError as exc:  # a value the environment set may be the one at fault
        if applied := [var.name for var in _CONFIG_ENV if var.get(environ) is not None]:
            raise ConfigError(f"{exc} (the environment sets {', '.join(applied)})") from None
        raise
    return cfg


def _located(raw: dict, exc: msgspec.ValidationError) -> str:
    """The error, naming the table: msgspec writes a model's or a preset's name as
    `[...]` (`$.models[...].dtype`), so the entry at fault is found by checking each."""
    for section, kind in (("models", ModelConfig), ("presets", PresetConfig)):
        entries = raw.get(section)
        if f"`$.{section}[...]" not in str(exc) or not isinstance(entries, dict):
            continue
        for name, entry in entries.items():
            try:
                msgspec.convert(entry, kind)
            except msgspec.ValidationError as one:
                key = name if subjects.is_token(name) else f'"{name}"'
                return f"[{section}.{key}]: {one}"
    return str(exc)


def load_cluster(
    path: str | Path | None = None, environ: Mapping[str, str] | None = None
) -> ClusterConfig:
    """Read the cluster file at `path` (default: $BATON_CLUSTER, then configs/local.toml)."""
    path = Path(path or Env.CLUSTER.get(environ) or DEFAULT_CLUSTER_FILE)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read cluster file {path}: {exc.strerror}") from None
    return parse_cluster(text, environ)


# The BATON_* variables _apply_env writes into the cluster's values: a value they set
# is checked with the file's, and its error names them (parse_cluster)
_CONFIG_ENV = (
    Env.NAMESPACE,
    Env.NATS_URL,
    Env.REDIS_URL,
    Env.HOST,
    Env.PORT,
    Env.LINK_HOST,
    Env.DTYPE,
    Env.WEIGHT_DTYPE,
    Env.DEVICE,
    Env.THREADS,
)


def _apply_env(raw: dict, environ: Mapping[str, str] | None) -> None:
    for var, key in (
        (Env.NAMESPACE, "namespace"),
        (Env.NATS_URL, "nats_url"),
        (Env.REDIS_URL, "redis_url"),
    ):
        if (value := var.get(environ)) is not None:
            raw[key] = value
    gateway = raw.setdefault("gateway", {})
    if (host := Env.HOST.get(environ)) is not None:
        gateway["host"] = host
    if (port := Env.PORT.get_int(environ)) is not None:
        gateway["port"] = port
    if (api_key := Env.API_KEY.get(environ)) is not None:
        gateway["api_keys"] = [*gateway.get("api_keys", []), api_key]
    if (link_host := Env.LINK_HOST.get(environ)) is not None:
        raw.setdefault("worker", {})["link_host"] = link_host
    # (read by shared/logging.py, in any case; checked here, where every service and
    # the launcher read their config)
    level = Env.LOG_LEVEL.get(environ)
    if level is not None and not isinstance(logging.getLevelName(level.upper()), int):
        raise ConfigError(f"{Env.LOG_LEVEL.name}={level!r}: use debug, info, warning or error")
    dtype, weight_dtype = Env.DTYPE.get(environ), Env.WEIGHT_DTYPE.get(environ)
    device = Env.DEVICE.get(environ)
    models = raw.get("models", {})
    for model in models.values() if isinstance(models, dict) else ():
        if not isinstance(model, dict):
            continue  # (the file's check names it)
        if dtype is not None:
            model["dtype"] = dtype
        if weight_dtype is not None:
            model["weight_dtype"] = weight_dtype
        if device is not None:
            model["device"] = device
    if (threads := Env.THREADS.get_int(environ)) is not None:
        for inst in raw.get("instances", []):
            if isinstance(inst, dict):
                inst["threads"] = threads
