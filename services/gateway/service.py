"""The gateway's non-HTTP half: bus, store, worker directory, routing and submission.

The HTTP handlers (app.py) call `admit` -> `route` -> `submit`, then read the
request's event queue; this object owns the connections and background tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
import uuid
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from services.gateway.config import GatewayServiceConfig
from services.gateway.links import WorkerLinks
from services.gateway.metrics import GatewayMetrics
from services.gateway.streams import RequestStream, StreamManager
from shared import subjects
from shared.bus import Bus, is_no_responders
from shared.link import FrameLink
from shared.logging import RetryLog, get_logger
from shared.messages import encode
from shared.messages.estimator import (
    ROUTE_REPLY_DECODER,
    RequestDoneEvent,
    RouteReply,
    RouteRequest,
)
from shared.messages.gateway import DELTA_BATCH_DECODER
from shared.messages.health import HEALTH_REPLY_DECODER, HealthProbe
from shared.messages.registry import RegistryEpoch, WorkerInfo, departed
from shared.messages.worker import CALIBRATION_DECODER, AbortRequest, SubmitRequest
from shared.sampling import SamplingParams
from shared.scheduling.unshown import UnshownRequests
from shared.store import SnapshotDecoder, Store

log = get_logger(component="gateway")
BUS_CHECK_S = 2.0  # how often the gateway pings NATS for /health (`_watch_bus`)
# a ping unanswered this long, seconds (nats-py takes whole ones): NATS is unresponsive
BUS_PING_TIMEOUT_S = 1


class GatewayError(Exception):
    """An HTTP error for one request, in OpenAI's format."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        # the response's headers: Retry-After, Allow, and those naming the request
        # (X-Request-Id: asgi.CompletionRoutes adds it; X-Instance-Id: completions.handle,
        # once the request was sent)
        self.headers = dict(headers or {})
        # the requested model, once the gateway knows it serves that name (the metric
        # label: never the client's raw string, whose values would be unbounded)
        self.model = ""
        if retry_after_s is not None:
            self.headers["Retry-After"] = str(retry_after_s)


class GatewayService:
    def __init__(self, cfg: GatewayServiceConfig) -> None:
        self.cfg = cfg
        self.cluster = cfg.cluster
        self._registry_epoch = RegistryEpoch(self.cluster.worker.heartbeat_ttl_s)
        self.settings = cfg.settings
        ns = cfg.cluster.namespace
        self.inbox_subject = subjects.gateway_inbox(ns, cfg.gateway_id)
        self._route_subject = subjects.estimator_route(ns)
        self._events_subject = subjects.estimator_events(ns)
        self.bus = Bus(cfg.cluster.nats_url, name=f"gateway-{cfg.gateway_id}")
        self.store = Store(cfg.cluster.redis_url, ns)
        self.streams = StreamManager()
        self.metrics = GatewayMetrics()
        self.workers: dict[str, WorkerInfo] = {}  # live instances, refreshed from Redis
        self.num_in_flight = 0
        # read when /metrics is scraped: a Gauge.set per admission and release costs
        # ~20-50 us of each request's path on cold caches (its lock)
        self.metrics.in_flight.set_function(lambda: self.num_in_flight)
        self._tokenizers: dict[str, Any] = {}
        self._max_prompt_chars: dict[str, int] = {}  # model -> max_prompt_chars
        # (temperature, top_p) for requests that send neither, per model and preset name:
        # fixed by the cluster file, so worked out once rather than per request
        self.sampling_defaults = {
            name: self.cluster.sampling_defaults(name)
            for name in (*self.cluster.models, *self.cluster.presets)
        }
        self._refresh_task: asyncio.Task[None] | None = None
        self._silence_task: asyncio.Task[None] | None = None
        self._bus_task: asyncio.Task[None] | None = None
        # NATS answered this gateway's last ping (`_watch_bus`). A server that hangs keeps
        # its connections open, so `bus.is_connected` stays true until nats-py's own
        # pings (every 2 minutes) give up: /health says "degraded" meanwhile.
        self.is_bus_responsive = True
        # The token-routing relay's answer to the last probe: "ok", "unresponsive" (it
        # hangs: routed requests stall), "down" (none subscribed: the launcher restarts
        # it), "unknown" (not asked yet); None: no preset routes per token, none asked.
        self.relay_state: str | None = "unknown" if self.cluster.token_presets() else None
        self._closing = False  # close() began: the refresh loop ends
        self._background: set[asyncio.Task[Any]] = set()
        self._fitted: dict[str, str] = {}  # instance -> feature set of its MAPE gauge
        self._snapshots = SnapshotDecoder(log)
        # Load per instance for routing without the estimator (route(), fallback):
        # requests in its latest snapshot, plus those this gateway sent there that no
        # snapshot shows yet.
        self._snapshot_load: dict[str, int] = {}
        self._unshown = UnshownRequests()
        self._no_estimator = RetryLog(log, "estimator_unreachable", recovered="estimator_reachable")
        self._fallback_turn = 0
        # monotonic time until which requests skip an estimator that timed out (a hung
        # one would otherwise cost every request route_timeout_s)
        self._skip_estimator_until = -math.inf
        self._estimator_suspect = False  # the last ask timed out: one request probes
        # This process's name in SubmitRequest.owner and its liveness key: the gateway id
        # plus a tag, so a restart under a fixed id does not adopt the dead one's requests.
        self.owner_token = f"{cfg.gateway_id}-{uuid.uuid4().hex[:8]}"
        # Renewed every registry refresh: live for at least three of them.
        self._liveness_ttl_s = max(
            self.cluster.worker.heartbeat_ttl_s, 3 * self.settings.registry_refresh_s
        )
        self._liveness_failures = RetryLog(log, "gateway_register_failed")
        # direct links to the workers that offer one (requests and their tokens)
        self.links = WorkerLinks(ns, self.owner_token, self.streams.dispatch, self._link_lost)

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        await self.bus.connect()
        await self.store.connect()
        await self.bus.subscribe(self.inbox_subject, DELTA_BATCH_DECODER, self.streams.on_batch)
        await self.bus.flush()
        for model in self.cluster.models:  # load tokenizers before the first request
            try:
                self.tokenizer(model).warm()
            except GatewayError as exc:  # e.g. a model not built yet: its requests get 503
                log.warning("tokenizer_unavailable", model=model, error=exc.message)
        await self._refresh_workers()
        self._refresh_task = asyncio.create_task(self._refresh_loop(), name="registry-refresh")
        self._silence_task = asyncio.create_task(self._watch_silence(), name="silence-watch")
        self._bus_task = asyncio.create_task(self._watch_bus(), name="bus-watch")
        log.info("gateway_ready", gateway_id=self.cfg.gateway_id, live_workers=len(self.workers))

    async def close(self) -> None:
        self._closing = True
        for task in (self._silence_task, self._bus_task):
            if task is not None:
                task.cancel()
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            await asyncio.wait([self._refresh_task], timeout=2.0)
        if self._background:
            await asyncio.wait(self._background, timeout=2.0)
        await self.links.close()
        with contextlib.suppress(Exception):  # best effort: it expires anyway
            await asyncio.wait_for(self.store.deregister_gateway(self.owner_token), 2.0)
        await self.bus.close()
        await self.store.close()

    def max_prompt_chars(self, model: str) -> int:
        """A prompt for `model` (a real model or a preset) longer than this in characters
        cannot fit its largest context: twice (room for a normalizer that shortens the
        text) the largest max_model_len of its instances times the most characters one
        token stands for. Without such a bound (not a byte-level vocabulary): no limit."""
        limit = self._max_prompt_chars.get(model)
        if limit is None:
            per_token = self.tokenizer(model).max_token_chars
            models = set(self.cluster.candidates(model))
            context = max(
                (i.scheduler.max_model_len for i in self.cluster.instances if i.model in models), default=0
            )
            limit = 2 * context * per_token if per_token and context else sys.maxsize
            self._max_prompt_chars[model] = limit
        return limit

    def tokenizer(self, model: str) -> Any:
        """The tokenizer of a real model or preset; GatewayError 503 if it cannot load."""
        name = self.cluster.tokenizer_for(model)
        tok = self._tokenizers.get(name)
        if tok is None:
            from shared.model_store import load_tokenizer

            try:
                tok = self._tokenizers[name] = load_tokenizer(name)
            except (OSError, ValueError) as exc:
                raise GatewayError(
                    503,
                    f"model {model!r} is not available here: {exc}",
                    "service_unavailable",
                    "model_unavailable",
                ) from None
        return tok

    # -- worker directory ------------------------------------------------------

    def serving(self, model: str) -> list[WorkerInfo]:
        """Live, non-draining instances that can serve `model` (a real model or a preset)."""
        candidates = set(self.cluster.candidates(model))
        return [w for w in self.routable() if w.model in candidates]

    def routable(self) -> list[WorkerInfo]:
        """Live instances requests may go to: registered, not draining, and not known
        gone before the registry says so (a link that died and whose port refuses)."""
        gone = self.links.unreachable
        return [w for w in self.workers.values() if not w.is_draining and w.instance_id not in gone]

    @property
    def is_ready(self) -> bool:
        return self.bus.is_connected and bool(self.routable())

    async def _refresh_loop(self) -> None:
        # Also ends on `_closing`: on Python 3.11 a cancellation that lands as one of
        # redis-py's sends completes is lost (`asyncio.wait_for`), and the loop would
        # run on after close().
        failures = RetryLog(log, "registry_refresh_failed")
        while not self._closing:
            await asyncio.sleep(self.settings.registry_refresh_s)
            if self._closing:
                return
            try:
                await self._refresh_workers()
            except Exception as exc:
                failures.failed(error=str(exc))
            else:
                failures.ok()

    async def _watch_silence(self) -> None:
        """Fail the requests whose worker sent nothing for event_timeout_s (504): looked
        at four times per timeout, at most once a second, so one fails at most a quarter
        of the timeout (or 1 s) late."""
        timeout_s = self.settings.event_timeout_s
        period_s = min(1.0, max(0.01, timeout_s / 4))  # never a spin, however built
        while not self._closing:
            await asyncio.sleep(period_s)
            self.streams.mark_silent(timeout_s, time.monotonic())

    async def _watch_bus(self) -> None:
        """Ping NATS every BUS_CHECK_S and note whether it answered within
        BUS_PING_TIMEOUT_S (`is_bus_responsive`, read by /health). A hung server (a
        stopped process, a full disk) stalls routing's and token routing's messages
        while plain requests still go over the workers' direct links. Where a preset
        routes per token, the relay's liveness probe too (`relay_state`): a hung relay
        stalls every routed request until the workers' `origin_wait_s`."""
        failures = RetryLog(log, "nats_unresponsive", recovered="nats_responsive")
        while not self._closing:
            if not self.bus.is_connected:
                await asyncio.sleep(BUS_CHECK_S)
                continue  # (reconnecting: /health says so already)
            try:
                await self.bus.flush(timeout_s=BUS_PING_TIMEOUT_S)
            except Exception as exc:
                if self._closing:
                    return
                self.is_bus_responsive = False
                failures.failed(error=type(exc).__name__)
            else:
                self.is_bus_responsive = True
                failures.ok()
                if self.relay_state is not None:
                    self.relay_state = await self._probe_relay()
            await asyncio.sleep(BUS_CHECK_S)  # (the first check at start: no "unknown" then)

    async def _probe_relay(self) -> str:
        try:
            await self.bus.request(
                subjects.health(self.cluster.namespace, "relay"),
                HealthProbe(sender=f"gateway-{self.cfg.gateway_id}"),
                HEALTH_REPLY_DECODER,
                timeout_s=BUS_PING_TIMEOUT_S,
            )
        except Exception as exc:
            return "down" if is_no_responders(exc) else "unresponsive"
        return "ok"

    def _link_lost(self, link: FrameLink) -> None:
        num = self.streams.fail_link(
            link, f"lost the connection to worker {link.name} while it served the request"
        )
        if num:
            log.warning("worker_link_lost", instance_id=link.name, num_failed=num)

    def _drop_request_gauges(self, instance_id: str) -> None:
        for state in ("running", "waiting", "pending"):
            with contextlib.suppress(KeyError):
                self.metrics.instance_requests.remove(instance_id, state)

    async def _refresh_workers(self) -> None:
        # This gateway lives: workers keep its requests (they abort a dead gateway's).
        # On its own: a failed write must not stop the registry read.
        try:
            await self.store.register_gateway(self.owner_token, ttl_s=self._liveness_ttl_s)
        except Exception as exc:
            self._liveness_failures.failed(error=str(exc))
        else:
            self._liveness_failures.ok()
        live = await self.store.read_live_workers(self.workers, self._registry_epoch)
        for gone in departed(self.workers, live):
            num = self.streams.fail_instance(
                gone, f"worker {gone} went away while serving the request"
            )
            log.warning("worker_gone", instance_id=gone, num_failed=num)
            self._drop_request_gauges(gone)
            fitted = self._fitted.pop(gone, None)
            if fitted is not None:
                with contextlib.suppress(KeyError):
                    self.metrics.batch_time_fit_mape.remove(gone, fitted)
        self.workers = live
        self.links.sync(live)
        self._snapshots.keep_only(live)
        self.metrics.live_workers.set(sum(not w.is_draining for w in live.values()))
        self.metrics.worker_links.set(self.links.num_up)
        snapshots = self._snapshots.decode(await self.store.read_snapshots(list(live)))
        self._snapshot_load = {iid: snap.num_requests for iid, snap in snapshots.items()}
        self._unshown.refresh(live, snapshots)  # (finish() drops the ended ones)
        for iid, snap in snapshots.items():
            self.metrics.instance_requests.labels(iid, "running").set(snap.num_running)
            self.metrics.instance_requests.labels(iid, "waiting").set(snap.num_waiting)
            # parked while a peer writes (token routing): they hold KV and request slots
            self.metrics.instance_requests.labels(iid, "pending").set(snap.num_pending)
        for iid in self._snapshots.undecodable:  # no figures rather than stale ones
            self._drop_request_gauges(iid)
        for iid, cal_blob in (await self.store.read_calibrations(list(live))).items():
            if cal_blob is None:
                continue
            cal = CALIBRATION_DECODER.decode(cal_blob)
            old = self._fitted.get(iid)
            if old is not None and old != cal.feature_set:
                with contextlib.suppress(KeyError):
                    self.metrics.batch_time_fit_mape.remove(iid, old)
            self._fitted[iid] = cal.feature_set
            self.metrics.batch_time_fit_mape.labels(iid, cal.feature_set).set(cal.mape)

    # -- one request -----------------------------------------------------------

    def admit(self) -> None:
        if self.num_in_flight >= self.settings.max_in_flight:
            raise GatewayError(
                429,
                f"too many requests in flight (limit {self.settings.max_in_flight}); retry shortly",
                "rate_limit_error",
                "too_many_requests",
                retry_after_s=self.settings.retry_after_s,
            )
        self.num_in_flight += 1

    def release(self) -> None:
        self.num_in_flight -= 1

    async def route(self, req: RouteRequest, avoid: AbstractSet[str] = frozenset()) -> RouteReply:
        """Ask the estimator which instance serves this request.

        With `route_single_locally`, a model that only one live instance serves is
        routed here without the round trip: there is nothing to choose. When no
        estimator answers (none subscribed: at once; a hung one: after
        `route_timeout_s`), the gateway routes the request itself to the instance with
        the fewest requests (`_fallback`) rather than fail it: an estimator that is
        restarting or gone costs the routing quality, not the answers. After a
        timeout the requests of the next `route_timeout_s` go straight to the
        fallback; then one request asks the estimator again while the others keep
        falling back, until an answer ends the suspicion.

        `avoid`: instances that refused or lost this request (a reroute: rare, so the
        gateway picks the shortest queue among the others itself).
        """
        model = req.model
        if not self.bus.is_connected:  # reconnecting: a request would only wait and time out
            raise self._bus_unavailable()
        if avoid:
            return self._shortest_queue(req, avoid, "gateway-reroute")
        if self.settings.route_single_locally:
            serving = self.serving(model)
            if len(serving) == 1:
                return _routed_here(req, serving[0], "single")
        now = time.monotonic()
        if now < self._skip_estimator_until:
            self._no_estimator.failed(error="skipped after a timeout")
            return self._fallback(req)
        if self._estimator_suspect:  # this request probes it; the others fall back meanwhile
            self._skip_estimator_until = now + self.settings.route_timeout_s
        try:
            reply = await self.bus.request(
                self._route_subject,
                req,
                ROUTE_REPLY_DECODER,
                timeout_s=self.settings.route_timeout_s,
            )
        except Exception as exc:
            if not self.bus.is_connected:  # the connection dropped while it waited
                raise self._bus_unavailable() from None
            if not (is_no_responders(exc) or isinstance(exc, TimeoutError)):
                raise
            self._no_estimator.failed(error=type(exc).__name__)
            if isinstance(exc, TimeoutError):
                self._estimator_suspect = True
                self._skip_estimator_until = time.monotonic() + self.settings.route_timeout_s
            return self._fallback(req)
        self._no_estimator.ok()
        self._estimator_suspect, self._skip_estimator_until = False, -math.inf
        if reply.instance_id is not None and reply.instance_id in self.links.unreachable:
            # its link died and its port refuses: the registry has not caught up yet
            return self._fallback(req)
        if reply.instance_id is None:
            if self.serving(model):
                # The estimator knows no live instance that this gateway does: each reads
                # the registry on its own interval, and its view is the older one (right
                # after start, or a worker's restart). The model and the policy were
                # checked here, so that is the only refusal left: route it here.
                return self._fallback(req)
            raise GatewayError(
                503,
                reply.error or f"no worker serves model {model!r}",
                "service_unavailable",
                "no_worker",
                retry_after_s=max(1, round(reply.retry_after_s)),
            )
        return reply

    def _fallback(self, req: RouteRequest) -> RouteReply:
        self.metrics.route_fallbacks.inc()
        return self._shortest_queue(req, frozenset(), "gateway-fallback")

    def _shortest_queue(
        self, req: RouteRequest, avoid: AbstractSet[str], policy: str
    ) -> RouteReply:
        """Shortest queue from this gateway's own view (snapshot requests + sent there
        and not shown yet), ties in turn, none of `avoid`; 503 when no live instance
        serves the model."""
        serving = sorted(
            (w for w in self.serving(req.model) if w.instance_id not in avoid),
            key=lambda w: w.instance_id,
        )
        if not serving:
            raise GatewayError(
                503,
                f"no live worker serves model {req.model!r}",
                "service_unavailable",
                "no_worker",
                retry_after_s=self.settings.retry_after_s,
            )

        def load(w: WorkerInfo) -> int:
            iid = w.instance_id
            return self._snapshot_load.get(iid, 0) + self._unshown.count(iid)

        least = min(load(w) for w in serving)
        ties = [w for w in serving if load(w) == least]
        self._fallback_turn += 1
        w = ties[self._fallback_turn % len(ties)]
        return _routed_here(req, w, policy)

    def _bus_unavailable(self) -> GatewayError:
        return GatewayError(
            503,
            "the message bus (NATS) is unreachable from this gateway; retry later",
            "service_unavailable",
            "bus_unavailable",
            retry_after_s=self.settings.retry_after_s,
        )

    async def submit(
        self,
        reply: RouteReply,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time_s: float,
        preset: str | None = None,
    ) -> RequestStream:
        assert reply.instance_id is not None and reply.inbox is not None
        stream = self.streams.open(request_id, reply.instance_id)
        if reply.predicted_ttft_source == "sfs":  # the replay's estimate: fed back at the end
            stream.predicted_ttft_ms = reply.predicted_ttft_ms
        msg = SubmitRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            params=params,
            reply_to=self.inbox_subject,
            arrival_time_s=arrival_time_s,
            predicted_output_tokens=reply.predicted_output_tokens,
            preset=preset,
            owner=self.owner_token,
        )
        stream.submitted_at = time.perf_counter()
        link = self.links.get(reply.instance_id)
        if link is not None and link.send(encode(msg)):
            stream.link = link  # its tokens come back on it, its abort goes on it
        else:
            try:
                await self.bus.publish(reply.inbox, msg)
            except BaseException:  # never sent: nothing will answer, nobody will close it
                self.streams.close(stream)
                raise
        self._unshown.add(reply.instance_id, request_id)
        return stream

    def finish(self, stream: RequestStream, *, aborted: bool) -> None:
        """The request is over for this gateway: abort it on the worker if needed, tell the
        estimators. Once per stream (a failed reroute's handler closes it again)."""
        if not self.streams.close(stream):
            return
        self._unshown.discard(stream.instance_id, stream.request_id)
        inbox = self.workers.get(stream.instance_id)
        if aborted and stream.link is not None:  # where it went (a closed link: aborted there)
            stream.link.send(encode(AbortRequest(request_id=stream.request_id)))
        elif aborted and inbox is not None:
            self._spawn(self.bus.publish(inbox.inbox, AbortRequest(request_id=stream.request_id)))
        done = RequestDoneEvent(
            request_id=stream.request_id,
            instance_id=stream.instance_id,
            predicted_ttft_ms=stream.predicted_ttft_ms,
            ttft_ms=stream.ttft_ms(),
        )
        self._spawn(self.bus.publish(self._events_subject, done))

    def _spawn(self, coro: Any) -> None:
        """Fire a publish that must not be cancelled with the HTTP handler, but keep its errors visible."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._background.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning("publish_failed", error=repr(t.exception()))

        task.add_done_callback(done)


def _routed_here(req: RouteRequest, worker: WorkerInfo, policy: str) -> RouteReply:
    """A decision the gateway made itself (no estimator round trip)."""
    return RouteReply(
        request_id=req.request_id,
        instance_id=worker.instance_id,
        model=worker.model,
        inbox=worker.inbox,
        policy=policy,
    )
