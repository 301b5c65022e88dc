"""Which instance serves a request: the estimator's decision, or the gateway's own.

With `route_single_locally`, a model that only one live instance serves is routed
here without the round trip: there is nothing to choose. When no estimator answers
(none subscribed: at once; a hung one: after `route_timeout_s`), the gateway routes
the request itself to the instance with the fewest requests (`fallback`) rather than
fail it: an estimator that is restarting or gone costs the routing quality, not the
answers. After a timeout the requests of the next `route_timeout_s` go straight to the
fallback; then one request asks the estimator again while the others keep falling
back, until an answer ends the suspicion.
"""

from __future__ import annotations

import math
import time
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING

from services.gateway.errors import bus_unavailable, no_worker
from shared.bus import Bus, is_no_responders
from shared.logging import RetryLog, get_logger
from shared.messages.estimator import ROUTE_REPLY_DECODER, RouteReply, RouteRequest
from shared.messages.registry import WorkerInfo

if TYPE_CHECKING:
    from services.gateway.directory import WorkerDirectory
    from services.gateway.metrics import GatewayMetrics
    from shared.config import GatewayConfig

log = get_logger(component="gateway")


def routed_here(req: RouteRequest, worker: WorkerInfo, policy: str) -> RouteReply:
    """A decision the gateway made itself (no estimator round trip)."""
    return RouteReply(
        request_id=req.request_id,
        instance_id=worker.instance_id,
        model=worker.model,
        inbox=worker.inbox,
        policy=policy,
    )


class Router:
    """Asks the estimator over the bus; routes by its own view when it cannot."""

    def __init__(
        self,
        bus: Bus,
        directory: WorkerDirectory,
        settings: GatewayConfig,
        metrics: GatewayMetrics,
        route_subject: str,
    ) -> None:
        self._bus = bus
        self._directory = directory
        self.settings = settings
        self._metrics = metrics
        self.route_subject = route_subject
        self._no_estimator = RetryLog(log, "estimator_unreachable", recovered="estimator_reachable")
        self._fallback_turn = 0
        # monotonic time until which requests skip an estimator that timed out (a hung
        # one would otherwise cost every request route_timeout_s)
        self._skip_estimator_until = -math.inf
        self._estimator_suspect = False  # the last ask timed out: one request probes

    async def route(self, req: RouteRequest, avoid: AbstractSet[str] = frozenset()) -> RouteReply:
        """The instance for this request. `avoid`: instances that refused or lost it (a
        reroute: rare, so the gateway picks the shortest queue among the others itself)."""
        model, settings = req.model, self.settings
        if not self._bus.is_connected:  # reconnecting: a request would only wait and time out
            raise bus_unavailable(settings.retry_after_s)
        if avoid:
            return self.shortest_queue(req, avoid, "gateway-reroute")
        if settings.route_single_locally:
            serving = self._directory.serving(model)
            if len(serving) == 1:
                return routed_here(req, serving[0], "single")
        now = time.monotonic()
        if now < self._skip_estimator_until:
            self._no_estimator.failed(error="skipped after a timeout")
            return self.fallback(req)
        if self._estimator_suspect:  # this request probes it; the others fall back meanwhile
            self._skip_estimator_until = now + settings.route_timeout_s
        try:
            reply = await self._bus.request(
                self.route_subject, req, ROUTE_REPLY_DECODER, timeout_s=settings.route_timeout_s
            )
        except Exception as exc:
            if not self._bus.is_connected:  # the connection dropped while it waited
                raise bus_unavailable(settings.retry_after_s) from None
            if not (is_no_responders(exc) or isinstance(exc, TimeoutError)):
                raise
            self._no_estimator.failed(error=type(exc).__name__)
            if isinstance(exc, TimeoutError):
                self._estimator_suspect = True
                self._skip_estimator_until = time.monotonic() + settings.route_timeout_s
            return self.fallback(req)
        self._no_estimator.ok()
        self._estimator_suspect, self._skip_estimator_until = False, -math.inf
        if reply.instance_id is not None and reply.instance_id in self._directory.links.unreachable:
            # its link died and its port refuses: the registry has not caught up yet
            return self.fallback(req)
        if reply.instance_id is None:
            if self._directory.serving(model):
                # The estimator knows no live instance that this gateway does: each reads
                # the registry on its own interval, and its view is the older one (right
                # after start, or a worker's restart). The model and the policy were
                # checked here, so that is the only refusal left: route it here.
                return self.fallback(req)
            raise no_worker(
                reply.error or f"no worker serves model {model!r}",
                max(1, round(reply.retry_after_s)),
            )
        return reply

    def fallback(self, req: RouteRequest) -> RouteReply:
        self._metrics.route_fallbacks.inc()
        return self.shortest_queue(req, frozenset(), "gateway-fallback")

    def shortest_queue(self, req: RouteRequest, avoid: AbstractSet[str], policy: str) -> RouteReply:
        """Shortest queue from this gateway's own view (WorkerDirectory.load), ties in
        turn, none of `avoid`; 503 when no live instance serves the model."""
        directory = self._directory
        serving = sorted(
            (w for w in directory.serving(req.model) if w.instance_id not in avoid),
            key=lambda w: w.instance_id,
        )
        if not serving:
            raise no_worker(
                f"no live worker serves model {req.model!r}", self.settings.retry_after_s
            )
        loads = [directory.load(w.instance_id) for w in serving]
        least = min(loads)
        ties = [w for w, load in zip(serving, loads, strict=True) if load == least]
        self._fallback_turn += 1
        return routed_here(req, ties[self._fallback_turn % len(ties)], policy)
