"""The worker service's configuration: one frozen object built once at start."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared import subjects
from shared.config import (
    ClusterConfig,
    ConfigError,
    Env,
    InstanceConfig,
    ModelConfig,
    PresetConfig,
    RelayConfig,
    WorkerConfig,
    require_token,
)

if TYPE_CHECKING:
    from services.worker.engine.config import EngineConfig
    from services.worker.engine.protocol import Engine


# The cluster file's [worker] defaults, for a config built without one (tests)
_WORKER_DEFAULTS = WorkerConfig()


@dataclass(frozen=True)
class WorkerServiceConfig:
    instance_id: str  # unique per process; a subject token
    model: str  # real model served
    namespace: str
    nats_url: str
    redis_url: str
    model_config: ModelConfig  # engine kind, dtype, device, batch-time model, sim settings
    instance: InstanceConfig  # scheduler limits, threads, seed
    heartbeat_interval_s: float
    heartbeat_ttl_s: float
    drain_timeout_s: float
    snapshot_ttl_s: float
    max_batch_samples: int
    # At most one snapshot write per this long (the newest state always written; 0: one
    # after every iteration, one in flight at a time)
    snapshot_interval_s: float = _WORKER_DEFAULTS.snapshot_interval_ms / 1000
    # ... and per this long while only progress changes (the same requests running on)
    snapshot_progress_interval_s: float = _WORKER_DEFAULTS.snapshot_progress_interval_ms / 1000
    # The token-level presets this model takes part in (services/worker/routing/).
    token_presets: dict[str, PresetConfig] = field(default_factory=dict)
    relay: RelayConfig = field(default_factory=lambda: RelayConfig())
    # A step runs inline on the event loop (not in a thread) when the prompts it admits
    # total at most max_inline_step_tokens (0: every step in a thread) and it is the first
    # after an idle wait or follows a step of at most max_inline_step_ms. Both save the
    # two thread hand-offs where they cost more than the loop's overlapped I/O (a quiet
    # worker's TTFT, a fast model's decode); a long step runs in a thread so the loop
    # stays free to take the inbox and publish.
    max_inline_step_tokens: int = _WORKER_DEFAULTS.max_inline_step_tokens
    max_inline_step_ms: float = _WORKER_DEFAULTS.max_inline_step_ms
    # a step's tokens may wait for the next step's write, up to this long (pacing.py)
    stream_interval_s: float = _WORKER_DEFAULTS.stream_interval_ms / 1000
    # the snapshot's batch_time_speed EWMA; 0: off
    batch_time_speed_alpha: float = _WORKER_DEFAULTS.batch_time_speed_alpha
    # the direct link gateways dial (shared/link.py); link = False: NATS only
    link: bool = _WORKER_DEFAULTS.link
    link_host: str = _WORKER_DEFAULTS.link_host
    link_port: int = _WORKER_DEFAULTS.link_port
    link_advertise_host: str = _WORKER_DEFAULTS.link_advertise_host
    link_unix: bool = _WORKER_DEFAULTS.link_unix  # also on a Unix socket, for this host

    @classmethod
    def from_cluster(
        cls, cluster: ClusterConfig, model: str, instance_id: str | None = None
    ) -> WorkerServiceConfig:
        if model not in cluster.models:
            raise ConfigError(
                f"unknown model {model!r}; the cluster file has {sorted(cluster.models)}"
            )
        explicit = instance_id or Env.INSTANCE_ID.get()
        why = "it names the worker's NATS subjects and Redis keys"
        return cls(
            instance_id=require_token(explicit, "instance id", why)
            if explicit
            else default_instance_id(model),
            model=model,
            namespace=cluster.namespace,
            nats_url=cluster.nats_url,
            redis_url=cluster.redis_url,
            model_config=cluster.models[model],
            instance=cluster.instance_for(model),
            heartbeat_interval_s=cluster.worker.heartbeat_interval_s,
            heartbeat_ttl_s=cluster.worker.heartbeat_ttl_s,
            drain_timeout_s=cluster.worker.drain_timeout_s,
            snapshot_ttl_s=cluster.worker.snapshot_ttl_s,
            max_batch_samples=cluster.worker.max_batch_samples,
            snapshot_interval_s=cluster.worker.snapshot_interval_ms / 1000,
            snapshot_progress_interval_s=cluster.worker.snapshot_progress_interval_ms / 1000,
            max_inline_step_tokens=cluster.worker.max_inline_step_tokens,
            max_inline_step_ms=cluster.worker.max_inline_step_ms,
            stream_interval_s=cluster.worker.stream_interval_ms / 1000,
            batch_time_speed_alpha=cluster.worker.batch_time_speed_alpha,
            link=cluster.worker.link,
            link_host=cluster.worker.link_host,
            link_port=cluster.worker.link_port,
            link_advertise_host=cluster.worker.link_advertise_host,
            link_unix=cluster.worker.link_unix,
            token_presets={n: p for n, p in cluster.token_presets().items() if model in p.models},
            relay=cluster.relay,
        )

    def engine_config(self) -> EngineConfig:
        """The torch engine's config (imports torch: call it only for engine = "torch")."""
        from services.worker.engine.config import EngineConfig

        inst = self.instance
        return EngineConfig(
            model=self.model,
            dtype=self.model_config.dtype,
            weight_dtype=self.model_config.weight_dtype,
            device=self.model_config.device,
            threads=inst.threads,
            seed=inst.seed,
            scheduler=inst.scheduler,
        )


def create_engine(cfg: WorkerServiceConfig) -> Engine:
    """Build the engine the cluster file names for this model: "torch" or "sim"."""
    if cfg.model_config.engine == "sim":
        from services.worker.engine.sim import SimEngine, SimEngineConfig
        from shared.scheduling.batch_time import BatchTimeModel

        inst = cfg.instance
        sim_cfg = SimEngineConfig(
            seed=inst.seed,
            scheduler=inst.scheduler,
            **cfg.model_config.sim,  # type: ignore[arg-type]
        )
        mc = cfg.model_config
        return SimEngine.create(
            sim_cfg, BatchTimeModel(mc.batch_time_features, tuple(mc.batch_time_coefs))
        )
    from services.worker.engine.engine import LLMEngine

    engine = LLMEngine.create(cfg.engine_config())
    warm_up(engine)
    return engine


WARM_UP_PROMPT_TOKENS = 16


def warm_up(engine: Engine) -> float:
    """Run one short request (a prefill and a decode step) through a new engine and
    forget it: torch's first calls (kernel selection, weight packing, allocator growth)
    happen here instead of in the first client's TTFT. Returns the seconds it took."""
    from shared.sampling import SamplingParams

    t0 = time.perf_counter()
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = list(range(1, WARM_UP_PROMPT_TOKENS + 1))
    engine.add_request("baton-warm-up", prompt, params)
    while engine.has_unfinished():
        engine.step()
    engine.pop_batch_samples()  # not the instance's timing: kept out of its calibration
    return time.perf_counter() - t0


def default_instance_id(model: str) -> str:
    """model-host-pid, made safe as a subject token (unique across compose replicas)."""
    return subjects.as_token(f"{model}-{socket.gethostname()}-{os.getpid()}")
