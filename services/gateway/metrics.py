"""Prometheus metrics of one gateway (a registry per app, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "baton_requests",
            "HTTP requests answered, by status and model: the one that answered, else the"
            ' name asked for; "" when the request names none served',
            ["model", "status"],
            registry=r,
        )
        self.ttft_s = Histogram(
            "baton_ttft_seconds",
            "time to first token",
            ["model"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.itl_s = Histogram(
            "baton_itl_seconds",
            "time between streamed deltas",
            ["model"],
            buckets=_ITL_BUCKETS_S,
            registry=r,
        )
        self.e2e_s = Histogram(
            "baton_e2e_seconds",
            "request latency, end to end",
            ["model"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.output_tokens = Counter(
            "baton_output_tokens", "tokens generated", ["model"], registry=r
        )
        self.in_flight = Gauge(
            "baton_in_flight_requests", "requests admitted and not finished", registry=r
        )
        self.queued = Gauge(
            "baton_queued_requests",
            "admitted requests still waiting for their first token",
            registry=r,
        )
        self.instance_requests = Gauge(
            "baton_instance_requests",
            "requests per instance by state, from its latest snapshot",
            ["instance", "state"],
            registry=r,
        )
        self.live_workers = Gauge(
            "baton_live_workers", "registered, non-draining workers", registry=r
        )
        self.worker_links = Gauge(
            "baton_worker_links",
            "direct links up from this gateway to workers (the rest take requests over NATS)",
            registry=r,
        )
        self.batch_time_fit_mape = Gauge(
            "baton_batch_time_fit_mape",
            "fit error (MAPE, fraction, inliers) of the estimator's batch-time model per instance",
            ["instance", "feature_set"],
            registry=r,
        )
        self.route_fallbacks = Counter(
            "baton_route_fallbacks",
            "requests the gateway routed itself (shortest queue) because no estimator "
            "answered, or it picked an instance this gateway knows is gone",
            registry=r,
        )
        self.reroutes = Counter(
            "baton_reroutes",
            "requests sent to another instance after a 503 before their first token (the "
            "worker was draining, or it or its link went away)",
            registry=r,
        )
        self.router_overhead_s = Histogram(
            "baton_router_overhead_seconds",
            "time the gateway waited for the routing decision",
            ["policy"],
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1),
            registry=r,
        )
