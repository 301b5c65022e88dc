"""The cluster file's names and its per-service sections ([gateway], [estimator],
[worker], [batcher], [relay]); msgspec validates types and rejects unknown keys."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

import msgspec

DEFAULT_CLUSTER_FILE = "configs/local.toml"

# Query-level policies a cluster file (or a request's x-baton-policy header) may name.
PolicyName = Literal[
    "round-robin",
    "shortest-queue",
    "latency-agnostic",
    "sfs-constraint",
    "sfs-lagrangian",
    "routebalance",
]
# Every query-level policy name (a request's x-baton-policy must name one of these).
POLICY_NAMES: tuple[str, ...] = get_args(PolicyName)
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


# ---------------------------------------------------------------------------
# Cluster file schema (msgspec validates types and rejects unknown keys)


class GatewayConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
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


class EstimatorConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
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
    # RouteBalance's batches: requests at most per batch, 0: adaptive to the share of busy
    # instances (4 / 16 / 32 requests, 50 / 100 / 200 ms); with a fixed size, the longest
    # the first request of a batch waits. An idle cluster decides at once either way.
    routebalance_batch_size: int = 0
    routebalance_batch_timeout_ms: float = 100.0  # ms
    cpus: Cpus = []  # CPU ids the estimator process runs on (empty: any)


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
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


class BatcherConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
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


class RelayConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
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
