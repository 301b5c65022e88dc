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

from shared.config.cluster import ClusterConfig, load_cluster, parse_cluster
from shared.config.env import ConfigError, Env, EnvVar, require_token, shown_url, url_refusal
from shared.config.models import (
    SIM_SETTINGS,
    InstanceConfig,
    ModelConfig,
    PresetConfig,
    fp16_weights_refusal,
)
from shared.config.sections import (
    DEFAULT_CLUSTER_FILE,
    POLICY_NAMES,
    SERVICES_WITH_CPUS,
    TOKEN_POLICY_NAMES,
    BatcherConfig,
    Cpus,
    EngineKind,
    EstimatorConfig,
    GatewayConfig,
    PolicyName,
    RelayConfig,
    TokenMode,
    WorkerConfig,
)

__all__ = [
    "DEFAULT_CLUSTER_FILE",
    "POLICY_NAMES",
    "SERVICES_WITH_CPUS",
    "SIM_SETTINGS",
    "TOKEN_POLICY_NAMES",
    "BatcherConfig",
    "ClusterConfig",
    "ConfigError",
    "Cpus",
    "EngineKind",
    "Env",
    "EnvVar",
    "EstimatorConfig",
    "GatewayConfig",
    "InstanceConfig",
    "ModelConfig",
    "PolicyName",
    "PresetConfig",
    "RelayConfig",
    "TokenMode",
    "WorkerConfig",
    "fp16_weights_refusal",
    "load_cluster",
    "parse_cluster",
    "require_token",
    "shown_url",
    "url_refusal",
]
