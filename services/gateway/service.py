"""The gateway's non-HTTP half: bus, store, worker directory, routing and submission.

The HTTP handlers (app.py) call `admit` -> `route` -> `submit`, then read the
request's event queue; this object owns the connections and background tasks. The
parts: the live workers and their load (directory.py), the routing decision
(router.py), the bus and relay checks /health reads (bus_watch.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import uuid
from collections.abc import Set as AbstractSet
from typing import Any

from services.gateway.bus_watch import BusWatch
from services.gateway.config import GatewayServiceConfig
from services.gateway.directory import WorkerDirectory
from services.gateway.errors import GatewayError
from services.gateway.links import WorkerLinks
from services.gateway.metrics import GatewayMetrics
from services.gateway.router import Router
from services.gateway.streams import RequestStream, StreamManager
from shared import subjects
from shared.bus import Bus
from shared.link import FrameLink
from shared.logging import RetryLog, get_logger
from shared.messages import encode
from shared.messages.estimator import RequestDoneEvent, RouteReply, RouteRequest
from shared.messages.gateway import DELTA_BATCH_DECODER
from shared.messages.registry import WorkerInfo
from shared.messages.worker import AbortRequest, SubmitRequest
from shared.sampling import SamplingParams
from shared.store import Store

log = get_logger(component="gateway")

__all__ = ["GatewayError", "GatewayService"]


class GatewayService:
    def __init__(self, cfg: GatewayServiceConfig) -> None:
        self.cfg = cfg
        self.cluster = cfg.cluster
        self.settings = cfg.settings
        ns = cfg.cluster.namespace
        self.inbox_subject = subjects.gateway_inbox(ns, cfg.gateway_id)
        self._events_subject = subjects.estimator_events(ns)
        self.bus = Bus(cfg.cluster.nats_url, name=f"gateway-{cfg.gateway_id}")
        self.store = Store(cfg.cluster.redis_url, ns)
        self.streams = StreamManager()
        self.metrics = GatewayMetrics()
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
        self.refresh_task: asyncio.Task[None] | None = None
        self._silence_task: asyncio.Task[None] | None = None
        self._bus_task: asyncio.Task[None] | None = None
        self.is_closing = False  # close() began: the background loops end
        self._background: set[asyncio.Task[Any]] = set()
        # This process's name in SubmitRequest.owner and its liveness key: the gateway id
        # plus a tag, so a restart under a fixed id does not adopt the dead one's requests.
        self.owner_token = f"{cfg.gateway_id}-{uuid.uuid4().hex[:8]}"
        # direct links to the workers that offer one (requests and their tokens)
        self.links = WorkerLinks(ns, self.owner_token, self.streams.dispatch, self._link_lost)
        self.directory = WorkerDirectory(
            self.cluster,
            self.settings,
            self.store,
            self.streams,
            self.metrics,
            self.links,
            self.owner_token,
        )
        self.router = Router(
            self.bus, self.directory, self.settings, self.metrics, subjects.estimator_route(ns)
        )
        self.bus_watch = BusWatch(
            self.bus,
            ns,
            f"gateway-{cfg.gateway_id}",
            has_relay=bool(self.cluster.token_presets()),
        )

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
        await self.directory.refresh()
        self.refresh_task = asyncio.create_task(self._refresh_loop(), name="registry-refresh")
        self._silence_task = asyncio.create_task(self._watch_silence(), name="silence-watch")
        self._bus_task = asyncio.create_task(
            self.bus_watch.run(lambda: self.is_closing), name="bus-watch"
        )
        log.info("gateway_ready", gateway_id=self.cfg.gateway_id, live_workers=len(self.workers))

    async def close(self) -> None:
        self.is_closing = True
        for task in (self._silence_task, self._bus_task):
            if task is not None:
                task.cancel()
        if self.refresh_task is not None:
            self.refresh_task.cancel()
            await asyncio.wait([self.refresh_task], timeout=2.0)
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
                (i.scheduler.max_model_len for i in self.cluster.instances if i.model in models),
                default=0,
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

    @property
    def workers(self) -> dict[str, WorkerInfo]:
        """Live instances by id, as the registry last showed them."""
        return self.directory.workers

    @property
    def is_ready(self) -> bool:
        return self.bus.is_connected and bool(self.directory.routable())

    @property
    def is_bus_responsive(self) -> bool:
        return self.bus_watch.is_bus_responsive

    @property
    def relay_state(self) -> str | None:
        return self.bus_watch.relay_state

    async def _refresh_loop(self) -> None:
        # Also ends on `is_closing`: on Python 3.11 a cancellation that lands as one of
        # redis-py's sends completes is lost (`asyncio.wait_for`), and the loop would
        # run on after close().
        failures = RetryLog(log, "registry_refresh_failed")
        while not self.is_closing:
            await asyncio.sleep(self.settings.registry_refresh_s)
            if self.is_closing:
                return
            await failures.attempt(self.directory.refresh)

    async def _watch_silence(self) -> None:
        """Fail the requests whose worker sent nothing for event_timeout_s (504): looked
        at four times per timeout, at most once a second, so one fails at most a quarter
        of the timeout (or 1 s) late."""
        timeout_s = self.settings.event_timeout_s
        period_s = min(1.0, max(0.01, timeout_s / 4))  # never a spin, however built
        while not self.is_closing:
            await asyncio.sleep(period_s)
            self.streams.mark_silent(timeout_s, time.monotonic())

    def _link_lost(self, link: FrameLink) -> None:
        num = self.streams.fail_link(
            link, f"lost the connection to worker {link.name} while it served the request"
        )
        if num:
            log.warning("worker_link_lost", instance_id=link.name, num_failed=num)

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
        """Which instance serves this request (router.py)."""
        return await self.router.route(req, avoid)

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
        self.directory.unshown.add(reply.instance_id, request_id)
        return stream

    def finish(self, stream: RequestStream, *, aborted: bool) -> None:
        """The request is over for this gateway: abort it on the worker if needed, tell the
        estimators. Once per stream (a failed reroute's handler closes it again)."""
        if not self.streams.close(stream):
            return
        self.directory.unshown.discard(stream.instance_id, stream.request_id)
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
