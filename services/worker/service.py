"""The worker service: one engine, driven by a loop of numbered steps.

    inbox (NATS callback, or a gateway's direct link) --> deque --+
                                      v
    loop:  1. take inbox     add_request / abort_request (errors -> RequestFailed)
           2. step           engine.step() in a thread (the event loop stays free), or
                             inline when it is short (below)
           3. publish        one DeltaBatch per owning gateway, on the link its
                             requests came on (shared/link.py), else over NATS; a
                             fast model's may wait for the next step's (pacing.py)
           4. record         snapshot + batch samples -> Redis (overlaps the next step;
                             one write at a time, the newest snapshot each)

Only the loop touches the engine, and never while a step runs in the thread,
so the engine needs no locks (the snapshot writer's `engine.snapshot()` is the one
read that may overlap a step: it returns the last published snapshot object). The hand-off to the thread and back costs two
wake-ups (and, for a step that is mostly Python, a GIL handed to and fro), ms on
a loaded machine; a step runs inline on the loop instead when it admits at most
`max_inline_step_tokens` prompt tokens and either is the first after an idle
wait (a quiet worker's new request: the TTFT case) or follows a step that took
at most `max_inline_step_ms` of compute, timed without the hand-off (a fast
model's decode batch: the hand-off would cost more than overlapping the loop's
I/O with the step saves; timed with it, a thread step's hand-off alone could
keep a fast model in the thread). Any other step
runs in the thread, so a busy loop keeps taking the inbox and publishing while
it computes.

A step that raises fails only the requests this worker holds: each owner gets a 500
and the engine frees their KV on the next step, and the worker serves on (a model
reload and a restart would cost seconds and fail them all the same). Past
`MAX_CONSECUTIVE_STEP_FAILURES` failed steps in a row the engine is taken as broken
and the error ends the process, for its supervisor to restart.

SIGTERM (or `request_stop`) drains: stop taking new requests, let running ones
finish within `drain_timeout_s`, abort the rest with a failure event,
deregister, exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from services.worker.admission import Admission
from services.worker.answers import Answers, Dest
from services.worker.config import WorkerServiceConfig, create_engine
from services.worker.engine.outputs import RequestOutput
from services.worker.engine.protocol import Engine, RoutableEngine
from services.worker.inbox import Inbox
from services.worker.links import GatewayLinks
from services.worker.pacing import group
from services.worker.registration import Registration
from services.worker.routing.driver import RoutingDriver
from services.worker.routing.runtime import TokenRouting
from services.worker.routing.tracked import Outbox
from services.worker.snapshot_writer import SnapshotWriter
from shared import subjects
from shared.bus import Bus
from shared.link import FrameLink
from shared.logging import get_logger
from shared.messages.gateway import GatewayEvent
from shared.messages.worker import (
    WORKER_INBOUND_DECODER,
    BatchTimeCalibration,
)
from shared.store import Store

log = get_logger(component="worker")
# failed steps in a row after which the worker exits rather than fail requests forever
# (one bad batch is contained; an engine that fails every step is broken: restart it)
MAX_CONSECUTIVE_STEP_FAILURES = 3

EngineFactory = Callable[[WorkerServiceConfig], Engine]


def _timed(step: Callable[[], list[RequestOutput]]) -> tuple[list[RequestOutput], float]:
    """step() and the seconds it took, timed where it runs (the loop or the thread)."""
    t0 = time.perf_counter()
    outputs = step()
    return outputs, time.perf_counter() - t0


class WorkerService:
    """One model instance on the bus. `run()` until `request_stop()`; nothing happens in __init__."""

    def __init__(
        self, cfg: WorkerServiceConfig, engine_factory: EngineFactory = create_engine
    ) -> None:
        self.cfg = cfg
        self.inbox_subject = subjects.worker_inbox(cfg.namespace, cfg.instance_id)
        self._engine_factory = engine_factory
        self._engine: Engine | None = None  # set by the start
        self._admission: Admission | None = None  # set by the start, after the engine
        self._bus = Bus(cfg.nats_url, name=f"worker-{cfg.instance_id}")
        self.store = Store(cfg.redis_url, cfg.namespace)
        # who each request answers to, and the pacer holding their events (answers.py)
        self.answers = Answers(cfg.instance_id, self._bus, cfg.stream_interval_s)
        self.writer: SnapshotWriter | None = None  # set once the engine is loaded
        self.registration = Registration(cfg, self.store, self.inbox_subject)
        self._wakeup = asyncio.Event()
        self.inbox = Inbox(self._wakeup)  # what came in, with the link it came on
        self._links: GatewayLinks | None = None  # gateways' direct links (cfg.link)
        self._stop = asyncio.Event()
        self.num_steps = 0
        self.num_inline_steps = 0  # of them, run on the event loop (short steps)
        self.num_failed_steps = 0  # steps that raised (their requests failed with a 500)
        self._consecutive_step_failures = 0
        # compute time of the last step (engine.step alone: in the thread, without the
        # hand-off, so that the inline rule sees the same figure in either mode)
        self._last_step_s = float("inf")
        self._dtype: str | None = None  # set when the engine loads
        self._weight_dtype: str | None = None  # (the sim engine has neither)
        self.heartbeat_task: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()  # set once the engine is loaded and the inbox subscribed
        # set once its start is over, just before the worker registers: its process
        # freezes the heap then (shared.runtime.freeze_heap), so the collection runs
        # before any request can come; a signal before it ends the start at once
        self.started = asyncio.Event()
        # Token-level routing (only when a token-level preset names this model).
        self._driver: RoutingDriver | None = None

    # -- lifecycle -----------------------------------------------------------

    def request_stop(self) -> None:
        """Begin a graceful drain (safe to call from a signal handler)."""
        self._stop.set()
        self._wakeup.set()

    async def run(self) -> None:
        try:
            await self._start()
            await self._loop()
        finally:
            await self.close()

    @property
    def routing(self) -> TokenRouting | None:
        """Token-level routing's runtime, when a token-level preset names this model."""
        return None if self._driver is None else self._driver.routing

    @property
    def calibration(self) -> BatchTimeCalibration | None:
        """The estimator's batch-time calibration of this instance, as last read."""
        return None if self.writer is None else self.writer.calibration

    @property
    def admission(self) -> Admission:
        """What the loop admits requests with: built with the engine, at the start."""
        if self._admission is None:
            raise RuntimeError("the worker has not started")
        return self._admission

    @property
    def engine(self) -> Engine:
        assert self._engine is not None, "the engine loads when the worker starts"
        return self._engine

    async def _start(self) -> None:
        t0 = time.perf_counter()
        self._engine = await asyncio.to_thread(self._engine_factory, self.cfg)
        self.writer = SnapshotWriter(self.cfg, self._engine, self.store, lambda: self.num_steps)
        # the dtype the engine runs (None for the sim engine, which has no torch config)
        engine_config = getattr(self._engine, "config", None)
        self._dtype = getattr(engine_config, "resolved_dtype", None)
        self._weight_dtype = getattr(engine_config, "resolved_weight_dtype", None)
        log.info(
            "engine_loaded",
            model=self.cfg.model,
            dtype=self._dtype,
            weight_dtype=self._weight_dtype,
            seconds=round(time.perf_counter() - t0, 2),
        )
        await self._bus.connect()
        await self.store.connect()
        await self._bus.subscribe(self.inbox_subject, WORKER_INBOUND_DECODER, self.inbox.on_bus)
        if self.cfg.link:
            self._links = self.registration.links = GatewayLinks(
                self.cfg.namespace,
                self.cfg.instance_id,
                self.registration.started_at_s,
                self.inbox.on_link,
                self._on_link_lost,
            )
            await self._links.start(
                self.cfg.link_host,
                self.cfg.link_port,
                self.cfg.link_advertise_host,
                unix=self.cfg.link_unix,
            )
        if self.cfg.token_presets:
            await self._start_routing()
        self._admission = Admission(self._engine, self.answers, self.registration, self.routing)
        await self._bus.flush()
        self.started.set()
        await asyncio.sleep(0)  # the process freezes its heap now, before it can be routed to
        await self.registration.register()
        beat = self.registration.heartbeat(self.writer, self.answers, self.inbox)
        self.heartbeat_task = asyncio.create_task(beat, name="heartbeat")
        self.writer.record(samples=False)
        self.ready.set()
        log.info("worker_ready", instance_id=self.cfg.instance_id, inbox=self.inbox_subject)

    async def _start_routing(self) -> None:
        self._driver = await RoutingDriver.start(
            self.cfg,
            self._bus,
            self.store,
            self._routable(),
            self._wakeup,
            (self._dtype, self._weight_dtype),
        )

    def _routable(self) -> RoutableEngine:
        """The engine, as token-level routing drives it (hand-offs, guests, resumes)."""
        engine = self.engine
        if not isinstance(engine, RoutableEngine):
            raise RuntimeError(
                f"{self.cfg.model}: token-level presets need an engine that hands off "
                f"tokens ({type(engine).__name__} does not)"
            )
        return engine

    async def close(self) -> None:
        """Deregister, flush, disconnect. Idempotent; each step bounded."""
        self.registration.stop_beating()
        with contextlib.suppress(Exception):  # whatever ended the loop: send what it held
            await asyncio.wait_for(self._flush_held(), 2.0)
        if self._driver is not None:
            self._driver.close()
        if self.heartbeat_task is not None:
            self.heartbeat_task.cancel()
            await asyncio.wait([self.heartbeat_task], timeout=2 * self.cfg.heartbeat_interval_s + 2)
            self.heartbeat_task = None
        if self.writer is not None:
            await self.writer.close()
        await self.registration.deregister()
        if self._links is not None:  # after the drain: the last deltas are written first
            await self._links.close()
        await self._bus.close()
        await self.store.close()
        log.info(
            "worker_closed",
            instance_id=self.cfg.instance_id,
            num_steps=self.num_steps,
            num_inline_steps=self.num_inline_steps,
        )

    # -- the loop ------------------------------------------------------------

    async def _loop(self) -> None:
        engine, writer, admission = self.engine, self.writer, self.admission
        assert writer is not None
        drain_deadline: float | None = None
        is_after_idle = True  # nothing ran since the engine was last empty
        has_peer_work = False  # peer messages applied since the last step
        while True:
            if self._stop.is_set() and drain_deadline is None:
                await self._flush_held()  # (the drain's registration may take a while)
                num_in_flight = len(self.answers.owners)
                drain_deadline = await self.registration.begin_drain(num_in_flight)
            # 1. take inbox (rejections are answered at once)
            rejected = admission.take(self.inbox)
            if drain_deadline is not None and time.monotonic() > drain_deadline:
                rejected += self._abort_all("the worker shut down before the request finished")
                drain_deadline = float("inf")  # abort once, then let the step report it
            if rejected:
                await self._publish(*group(rejected))
            outbox = Outbox()
            driver = self._driver
            if driver is not None and await driver.between_steps(outbox):
                # A peer's copy brings a sequence the prompt count misses: the next step
                # runs in the thread.
                is_after_idle, has_peer_work = False, True
            if not engine.has_unfinished():
                if drain_deadline is not None:
                    return  # (close() sends anything still held)
                is_after_idle = True
                await self._idle()
                continue
            if not engine.can_progress():
                # Nothing to compute: every admitted request is parked at a peer (or
                # waits on one), any others wait for the slots or the KV they hold. A
                # message (a resume, a request, an abort) ends this wait.
                await self._idle()
                continue
            wait_s = None if driver is None else driver.hold_s()
            if wait_s is not None:  # nothing runnable yet, or delayed batching holds
                await self._idle(wait_s)
                continue
            # 2. step (off the event loop, unless it is short: see the module docstring)
            if has_peer_work or admission.num_new_prompt_tokens:
                await self._flush_held()  # a prefill or peer work: longer than the last step
            t_step = time.perf_counter()
            try:
                if not has_peer_work and self._steps_inline(is_after_idle):
                    outputs, self._last_step_s = _timed(engine.step)  # blocks the loop briefly
                    self.num_inline_steps += 1
                else:
                    outputs, self._last_step_s = await asyncio.to_thread(_timed, engine.step)
            except Exception as exc:
                await self._fail_step(exc)  # raises once the engine looks broken
                is_after_idle = has_peer_work = False
                continue
            self._consecutive_step_failures = 0
            is_after_idle = has_peer_work = False
            admission.num_new_prompt_tokens = 0
            self.num_steps += 1
            final_counts = None
            if driver is not None:
                outputs = await driver.after_step(outputs, time.perf_counter() - t_step, outbox)
                final_counts = driver.routing.final_counts
            # 3. publish deltas, one batch per owning gateway (or held for the next
            #    step's: pacing.py)
            by_dest, urgent = self.answers.deltas(outputs, final_counts)
            await self._publish(by_dest, urgent, next_step_s=self._last_step_s)
            # One pass of the event loop: it reads what arrived (submits and aborts, on
            # links and NATS), and nats-py's flusher task writes what went over NATS
            # (once the next step runs, its thread holds the GIL and that write would
            # wait a switch interval; a link's write is already done).
            await asyncio.sleep(0)
            # 4. record snapshot and batch samples (written while the next step runs)
            writer.record(samples=True)

    def _steps_inline(self, is_after_idle: bool) -> bool:
        """Whether the next step runs on the event loop rather than in the thread."""
        new, cap = self.admission.num_new_prompt_tokens, self.cfg.max_inline_step_tokens
        if cap == 0 or new > cap:
            return False  # a prefill too long to hold the loop for (cap 0: never inline)
        if is_after_idle:
            return new > 0
        return self._last_step_s * 1000 <= self.cfg.max_inline_step_ms

    async def _idle(self, wait_s: float | None = None) -> None:
        """Nothing to run: wait for the inbox (at most wait_s), refreshing the snapshot so
        it never goes stale."""
        await self._flush_held()
        self._wakeup.clear()
        if self.inbox or self._stop.is_set():
            return
        if self._driver is not None and self._driver.has_messages:
            return
        timeout = self.cfg.heartbeat_interval_s if wait_s is None else wait_s
        try:
            # asyncio.timeout, not wait_for: no task per wait, one loop pass fewer to wake.
            async with asyncio.timeout(timeout):
                await self._wakeup.wait()
        except TimeoutError:
            if wait_s is None and self.writer is not None:
                self.writer.record(samples=False)

    async def _publish(
        self,
        by_dest: dict[Dest, list[GatewayEvent]],
        urgent: set[Dest],
        next_step_s: float | None = None,
    ) -> None:
        await self.answers.publish(by_dest, urgent, self.num_steps, next_step_s)

    async def _flush_held(self) -> None:
        await self.answers.flush(self.num_steps)

    # -- links, failures ------------------------------------------------------

    def _on_link_lost(self, link: FrameLink) -> None:
        """A gateway's link closed: abort the requests it brought (their gateway died or
        was cut off, and fails them on its side), through the inbox as a client's abort."""
        self.answers.forget_link(link)
        # requests still in the inbox from it: admitted, then aborted right after
        lost = self.answers.requests_of(link) + self.inbox.submits_from(link)
        if lost:
            log.warning("gateway_link_lost", gateway=link.name, num_aborted=len(lost))
            self.inbox.abort(lost)
        else:
            log.info("gateway_unlinked", gateway=link.name)

    async def _fail_step(self, exc: Exception) -> None:
        """A step raised: fail every request this worker holds with a 500 and free their
        KV (the engine applies the aborts at the start of the next step), then serve on;
        re-raise once `MAX_CONSECUTIVE_STEP_FAILURES` steps in a row have failed.

        Which request broke the batch is unknown, so all of them go: the step may have
        left any of them half advanced. Token-routing guests (copies a peer owns) are
        not this worker's to answer; their origins' silence checks drop them."""
        self.num_failed_steps += 1
        self._consecutive_step_failures += 1
        self._last_step_s = float("inf")  # the next step (the aborts) runs in the thread
        log.error(
            "step_failed",
            error=f"{type(exc).__name__}: {exc}",
            num_failed_requests=len(self.answers.owners),
            consecutive=self._consecutive_step_failures,
            exc_info=exc,
        )
        if self._consecutive_step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise RuntimeError(
                f"{self._consecutive_step_failures} engine steps in a row failed; "
                "the worker exits for its supervisor to restart it"
            ) from exc
        reason = f"the model failed on this request's batch ({type(exc).__name__}: {exc})"
        await self._publish(*group(self._fail_all(500, reason)))

    def _abort_all(self, reason: str) -> list[tuple[Dest, GatewayEvent]]:
        """Drain timed out: abort what still runs; return the failures to send its gateways."""
        log.warning("drain_timeout", num_aborted=len(self.answers.owners))
        return self._fail_all(503, reason)

    def _fail_all(self, status: int, reason: str) -> list[tuple[Dest, GatewayEvent]]:
        """Abort every request this worker holds (their KV is freed at the next step);
        return the failures to send their gateways."""
        for request_id in self.answers.owners:
            self.engine.abort_request(request_id)
        return self.answers.fail_all(status, reason)
