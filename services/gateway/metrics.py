"""Prometheus metrics of one gateway (a registry per app, so tests can run several)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_ROUTER_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


class GatewayMetrics:
    """Every `baton_*` series a gateway exports (docs/operations.md lists them)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = self._counter(
            "baton_requests",
            "HTTP requests answered, by status and model: the one that answered, else the"
            ' name asked for; "" when the request names none served',
            ("model", "status"),
        )
        self.ttft_s = self._histogram(
            "baton_ttft_seconds", "time to first token", ("model",), _LATENCY_BUCKETS_S
        )
        self.itl_s = self._histogram(
            "baton_itl_seconds", "time between streamed deltas", ("model",), _ITL_BUCKETS_S
        )
        self.e2e_s = self._histogram(
            "baton_e2e_seconds", "request latency, end to end", ("model",), _LATENCY_BUCKETS_S
        )
        self.output_tokens = self._counter("baton_output_tokens", "tokens generated", ("model",))
        self.in_flight = self._gauge(
            "baton_in_flight_requests", "requests admitted and not finished"
        )
        self.queued = self._gauge(
            "baton_queued_requests", "admitted requests still waiting for their first token"
        )
        self.instance_requests = self._gauge(
            "baton_instance_requests",
            "requests per instance by state, from its latest snapshot",
            ("instance", "state"),
        )
        self.live_workers = self._gauge("baton_live_workers", "registered, non-draining workers")
        self.worker_links = self._gauge(
            "baton_worker_links",
            "direct links up from this gateway to workers (the rest take requests over NATS)",
        )
        self.batch_time_fit_mape = self._gauge(
            "baton_batch_time_fit_mape",
            "fit error (MAPE, fraction, inliers) of the estimator's batch-time model per instance",
            ("instance", "feature_set"),
        )
        self.route_fallbacks = self._counter(
            "baton_route_fallbacks",
            "requests the gateway routed itself (shortest queue) because no estimator "
            "answered, or it picked an instance this gateway knows is gone",
        )
        self.reroutes = self._counter(
            "baton_reroutes",
            "requests sent to another instance after a 503 before their first token (the "
            "worker was draining, or it or its link went away)",
        )
        self.router_overhead_s = self._histogram(
            "baton_router_overhead_seconds",
            "time the gateway waited for the routing decision",
            ("policy",),
            _ROUTER_BUCKETS_S,
        )

    def _counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(name, doc, list(labels), registry=self.registry)

    def _gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(name, doc, list(labels), registry=self.registry)

    def _histogram(
        self, name: str, doc: str, labels: Sequence[str], buckets: Sequence[float]
    ) -> Histogram:
        return Histogram(name, doc, list(labels), buckets=buckets, registry=self.registry)
