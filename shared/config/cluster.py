"""One deployment's config (ClusterConfig), read from a cluster file with the
environment's overrides applied and checked once."""

from __future__ import annotations

import logging
import tomllib
from collections.abc import Mapping
from pathlib import Path

import msgspec

from shared import subjects
from shared.config.env import ConfigError, Env, require_token, shown_url, url_refusal
from shared.config.models import InstanceConfig, ModelConfig, PresetConfig
from shared.config.sections import (
    DEFAULT_CLUSTER_FILE,
    SERVICES_WITH_CPUS,
    TOKEN_POLICY_NAMES,
    BatcherConfig,
    Cpus,
    EstimatorConfig,
    GatewayConfig,
    RelayConfig,
    WorkerConfig,
)
from shared.scheduling.scheduler import SchedulerConfig


class ClusterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
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
        for name, preset in self.presets.items():
            w = preset.routebalance_weights
            if w and (len(w) not in (3, 4) or min(w) < 0 or abs(sum(w) - 1.0) > 1e-6):
                raise ConfigError(
                    f"[presets.{name}] routebalance_weights must be 3 (quality, latency, cost) "
                    f"or 4 (+ balance) non-negative numbers summing to 1, got {w}"
                )
        if self.estimator.routebalance_batch_size < 0:
            raise ConfigError("[estimator] routebalance_batch_size must be >= 0 (0: adaptive)")
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
    _check_scheduler_tables(raw)
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


def _check_scheduler_tables(raw: dict) -> None:
    """The limits live in [instances.scheduler] and nowhere else: a limit written in
    [[instances]] itself, or an unknown key in the table, is named. (SchedulerConfig
    itself takes unknown keys, so that a snapshot from a newer worker still decodes.)"""
    known = set(SchedulerConfig.__struct_fields__)
    instances = raw.get("instances", [])
    for inst in instances if isinstance(instances, list) else ():
        if not isinstance(inst, dict):
            continue  # (the file's check names it)
        where = f"[[instances]] of {inst.get('model', '?')!r}"
        if flat := sorted(known & set(inst)):
            raise ConfigError(f"{where}: move {', '.join(flat)} into [instances.scheduler]")
        table = inst.get("scheduler", {})
        if isinstance(table, dict) and (unknown := sorted(set(table) - known)):
            raise ConfigError(
                f"{where}: unknown [instances.scheduler] key {', '.join(map(repr, unknown))}; "
                f"use {', '.join(sorted(known))}"
            )


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
