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
from collections import deque
from collections.abc import Callable, Container
from typing import Any, NamedTuple

import msgspec

from services.worker.config import WorkerServiceConfig, create_engine
from services.worker.links import GatewayLinks
from services.worker.pacing import StreamPacer, group, is_urgent
from services.worker.routing.chars import CharBoundaries
from services.worker.routing.link import RoutingLink
from services.worker.routing.runtime import Outbox, TokenRouting
from shared import subjects
from shared.bus import Bus, is_no_responders
from shared.link import FrameLink
from shared.logging import RetryLog, get_logger
from shared.messages import encode
from shared.messages.gateway import DeltaBatch, GatewayEvent, RequestFailed, TokenDelta
from shared.messages.peer import PEER_QUERY_REPLY_DECODER, PeerQuery
from shared.messages.registry import WorkerInfo
from shared.messages.worker import (
    CALIBRATION_DECODER,
    WORKER_INBOUND_DECODER,
    AbortRequest,
    BatchTimeCalibration,
    SubmitRequest,
    WorkerInbound,
)
from shared.scheduling.batch_time import BatchTimeModel
from shared.scheduling.snapshot import BatchSample
from shared.scheduling.speed import RecentSpeed
from shared.store import Store
from shared.subjects import is_token

log = get_logger(component="worker")
EXPIRY_CHECK_S = 0.5  # how often parked token-routing requests are checked for silence
# heartbeat TTLs a request's owning gateway may stay unregistered before its requests
# are aborted (`_abort_orphans`)
ORPHAN_GRACE_TTLS = 2.0
RELAY_QUERY_TIMEOUT_S = 1.0  # a relay that does not answer within this is taken as gone
# failed steps in a row after which the worker exits rather than fail requests forever
# (one bad batch is contained; an engine that fails every step is broken: restart it)
MAX_CONSECUTIVE_STEP_FAILURES = 3

EngineFactory = Callable[[WorkerServiceConfig], Any]


class Owner(NamedTuple):
    """Who a running request answers to."""

    reply_to: str  # the owning gateway's inbox subject
    gateway: str  # its liveness token (SubmitRequest.owner; `_abort_orphans`); "": unchecked
    link: FrameLink | None  # the direct link it came on: its answers go there
    dest: Dest  # answer_to(reply_to, link)


# Where a gateway event goes: a direct link, or a NATS subject (the gateway's inbox).
Dest = str | FrameLink


def answer_to(reply_to: str, link: FrameLink | None) -> Dest:
    """A request is answered on the link it came on, else on its gateway's inbox."""
    return reply_to if link is None else link


def _request_set(snapshot: Any) -> tuple[int, int, list[str]]:
    """What a snapshot says of who is where (running, pending, waiting by id): a snapshot
    that differs from the last written one in this is written sooner than one that
    only shows progress (WorkerService._record)."""
    return snapshot.num_running, snapshot.num_pending, snapshot.request_ids


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


def _timed(step: Callable[[], list[Any]]) -> tuple[list[Any], float]:
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
        self._engine: Any = None
        self._bus = Bus(cfg.nats_url, name=f"worker-{cfg.instance_id}")
        self._store = Store(cfg.redis_url, cfg.namespace)
        # what came in, with the direct link it came on (None: over NATS)
        self._inbox: deque[tuple[WorkerInbound, FrameLink | None]] = deque()
        self._links: GatewayLinks | None = None  # gateways' direct links (cfg.link)
        self._wakeup = asyncio.Event()
        self._stop = asyncio.Event()
        self._owners: dict[str, Owner] = {}  # request id -> its owning gateway
        # deltas held back for the next step's write to their gateway (pacing.py)
        self._pacer: StreamPacer[Dest] = StreamPacer(cfg.stream_interval_s)
        self._gone_since: dict[str, float] = {}  # gateway id -> monotonic time seen gone
        self._num_steps = 0
        self.num_inline_steps = 0  # of them, run on the event loop (short steps)
        self.num_failed_steps = 0  # steps that raised (their requests failed with a 500)
        self.num_link_requests = 0  # requests admitted from a direct link (not NATS)
        self._consecutive_step_failures = 0
        self._write_failures = RetryLog(log, "snapshot_write_failed")  # Redis outages
        # Prompt tokens admitted since the last step: the size of an inline step's prefill.
        self._num_new_prompt_tokens = 0
        # compute time of the last step (engine.step alone: in the thread, without the
        # hand-off, so that the inline rule sees the same figure in either mode)
        self._last_step_s = float("inf")
        self._dtype: str | None = None  # set when the engine loads
        self._weight_dtype: str | None = None  # (the sim engine has neither)
        self._next_expiry_s = 0.0  # monotonic time of the next relay-silence check
        self._relay_query: asyncio.Task[None] | None = None  # a PeerQuery in flight
        # the relay's answer, applied by the loop: (asked ids with the time their
        # hand-off left, ids it still times)
        self._relay_verdict: tuple[dict[str, float], set[str]] | None = None
        self._started_at_s = time.time()
        self._is_draining = False
        self._record_task: asyncio.Task[None] | None = None  # the snapshot writer, if running
        self._record_pending = False  # a step ended since the writer took its snapshot
        # ... and changed the request set (arrived, finished, changed queue) since the
        # last write: written within snapshot_interval_s, not snapshot_progress_interval_s
        self._record_changed = False
        # a writer waiting out the progress interval waits on this: a change resolves
        # it early, a timer at the interval's end otherwise (a future and a timer
        # handle: no task cancelled every 20 ms, as asyncio.timeout would)
        self._record_wake: asyncio.Future[None] | None = None
        self._written_sig: tuple[int, int, list[str]] | None = None  # (`_request_set`)
        self._last_write_s = float("-inf")  # monotonic time the writer last took one
        self._unsent_samples: list[BatchSample] = []  # not yet written (at most
        # max_batch_samples: Redis keeps no more, so a stalled write drops the oldest)
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._closing = False
        # The estimator's fitted batch-time model of this instance, read with the
        # heartbeat; copied into every snapshot (the engine's own, if any, otherwise).
        self.calibration: BatchTimeCalibration | None = None
        self._calibrated: BatchTimeModel | None = None  # the calibration as a model
        # How fast the latest iterations ran against the calibration (speed.py): the
        # snapshot's batch_time_speed, so a replay prices the next steps at it.
        alpha = cfg.batch_time_speed_alpha
        self._speed = RecentSpeed(alpha=alpha) if alpha > 0 else None
        self.ready = asyncio.Event()  # set once the engine is loaded and the inbox subscribed
        # set once its start is over, just before the worker registers: its process
        # freezes the heap then (shared.runtime.freeze_heap), so the collection runs
        # before any request can come; a signal before it ends the start at once
        self.started = asyncio.Event()
        # Token-level routing (only when a token-level preset names this model).
        self.routing: TokenRouting | None = None
        self._link: RoutingLink | None = None

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

    async def _start(self) -> None:
        t0 = time.perf_counter()
        self._engine = await asyncio.to_thread(self._engine_factory, self.cfg)
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
        await self._store.connect()
        await self._bus.subscribe(self.inbox_subject, WORKER_INBOUND_DECODER, self._on_inbound)
        if self.cfg.link:
            self._links = GatewayLinks(
                self.cfg.namespace,
                self.cfg.instance_id,
                self._started_at_s,
                self._on_link_inbound,
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
        await self._bus.flush()
        self.started.set()
        await asyncio.sleep(0)  # the process freezes its heap now, before it can be routed to
        await self._register()
        self._heartbeat_task = asyncio.create_task(self._heartbeat(), name="heartbeat")
        self._record(samples=False)
        self.ready.set()
        log.info("worker_ready", instance_id=self.cfg.instance_id, inbox=self.inbox_subject)

    async def _start_routing(self) -> None:
        from services.worker.routing.policies import create_token_policy

        self.routing = TokenRouting(
            self.cfg.instance_id,
            self.cfg.model,
            self.cfg.token_presets,
            lambda name, models, index, args: create_token_policy(name, models, index, args),
            self._char_boundaries(),
        )
        self._engine.hook = self.routing.hook
        self._link = RoutingLink(
            self.routing,
            self._bus,
            self._store,
            self.cfg.namespace,
            self._wakeup,
            self.cfg.relay.stats_interval_s,
        )
        await self._link.start()
        log.info("token_routing_ready", presets=sorted(self.routing.policies))
        serving = (self._dtype, self._weight_dtype)
        for preset, policy in self.routing.policies.items():
            meta = getattr(policy, "meta", {})
            # routers from before weight_dtype held their weights in the compute dtype
            trained = (meta.get("dtype"), meta.get("weight_dtype", meta.get("dtype")))
            reads_here = meta.get("small_model", self.cfg.model) == self.cfg.model
            if reads_here and None not in trained and None not in serving and trained != serving:
                # The router reads this engine's hidden states; its threshold was set
                # on another numeric's (close, not equal): say so rather than drift quietly.
                log.warning(
                    "router_dtype_differs",
                    preset=preset,
                    trained_on={"dtype": trained[0], "weight_dtype": trained[1]},
                    serving={"dtype": serving[0], "weight_dtype": serving[1]},
                    fix=f"set dtype = {trained[0]!r} for {self.cfg.model} in the cluster "
                    f"file, or rebuild the routers with `just routers --dtype {serving[0]}` "
                    "on a machine that serves them alike",
                )

    def _char_boundaries(self) -> CharBoundaries | None:
        """The model's vocabulary, for hand-offs to wait for a character's end
        (routing/chars.py); None, with a warning, when its tokenizer cannot load."""
        try:
            return CharBoundaries(self._engine.tokenizer().token_bytes)
        except Exception as exc:  # (the hand-offs go on, characters unguarded)
            log.warning("token_bytes_unavailable", model=self.cfg.model, error=repr(exc))
            return None

    async def close(self) -> None:
        """Deregister, flush, disconnect. Idempotent; each step bounded."""
        self._closing = True
        with contextlib.suppress(Exception):  # whatever ended the loop: send what it held
            await asyncio.wait_for(self._flush_held(), 2.0)
        if self._relay_query is not None:
            self._relay_query.cancel()  # its answer has nobody left to apply it
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            await asyncio.wait(
                [self._heartbeat_task], timeout=2 * self.cfg.heartbeat_interval_s + 2
            )
            self._heartbeat_task = None
        if self._record_task is not None:
            _wake(self._record_wake)  # a writer waiting out progress writes the last state now
            await asyncio.gather(self._record_task, return_exceptions=True)
            self._record_task = None
        if self._store.is_connected:
            try:
                await asyncio.wait_for(self._store.deregister(self.cfg.instance_id), 2.0)
            except Exception as exc:
                log.warning("deregister_failed", error=str(exc))
        if self._links is not None:  # after the drain: the last deltas are written first
            await self._links.close()
        await self._bus.close()
        await self._store.close()
        log.info(
            "worker_closed",
            instance_id=self.cfg.instance_id,
            num_steps=self._num_steps,
            num_inline_steps=self.num_inline_steps,
        )

    # -- the loop ------------------------------------------------------------

    async def _loop(self) -> None:
        engine = self._engine
        drain_deadline: float | None = None
        is_after_idle = True  # nothing ran since the engine was last empty
        has_peer_work = False  # peer messages applied since the last step
        while True:
            if self._stop.is_set() and drain_deadline is None:
                await self._flush_held()  # (the drain's registration may take a while)
                drain_deadline = await self._begin_drain()
            # 1. take inbox (rejections are answered at once)
            rejected = self._take_inbox()
            if drain_deadline is not None and time.monotonic() > drain_deadline:
                rejected += self._abort_all("the worker shut down before the request finished")
                drain_deadline = float("inf")  # abort once, then let the step report it
            if rejected:
                await self._publish(*group(rejected))
            outbox = Outbox()
            if self._link is not None:  # peer messages: start, resume or release copies
                if self._link.has_messages:
                    # A peer's copy brings a sequence the prompt count misses: the next
                    # step runs in the thread.
                    is_after_idle, has_peer_work = False, True
                self._link.apply(engine, outbox)
                if self.routing is not None and (
                    self._link.relay_started_at_s is not None
                    or self._relay_verdict is not None
                    or time.monotonic() >= self._next_expiry_s
                ):
                    self._check_relay_silence(engine, outbox)
                await self._link.publish(outbox)
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
            wait_s = self._hold_s()
            if wait_s is not None:  # nothing runnable yet, or delayed batching holds
                await self._idle(wait_s)
                continue
            # 2. step (off the event loop, unless it is short: see the module docstring)
            if has_peer_work or self._num_new_prompt_tokens:
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
            self._num_new_prompt_tokens = 0
            self._num_steps += 1
            if self.routing is not None and self._link is not None:
                self.routing.record_step(time.perf_counter() - t_step)
                outputs = self.routing.on_outputs(outputs, outbox)
                self.routing.on_handoffs(engine.pop_handoffs(), engine, outbox)
                await self._link.publish(outbox)
                await self._link.maybe_send_stats()
            # 3. publish deltas, one batch per owning gateway (or held for the next
            #    step's: pacing.py)
            await self._publish(*self._deltas(outputs), next_step_s=self._last_step_s)
            # One pass of the event loop: it reads what arrived (submits and aborts, on
            # links and NATS), and nats-py's flusher task writes what went over NATS
            # (once the next step runs, its thread holds the GIL and that write would
            # wait a switch interval; a link's write is already done).
            await asyncio.sleep(0)
            # 4. record snapshot and batch samples (written while the next step runs)
            self._record(samples=True)

    def _check_relay_silence(self, engine: Any, outbox: Outbox) -> None:
        """The safety nets for a relay that is itself gone (TokenRouting.overdue_origins):
        apply the relay's last answer about overdue requests, ask it about the ones
        overdue now (in the background: the answer is applied here, between steps),
        and drop long-idle peer copies."""
        assert self.routing is not None
        now = time.monotonic()
        self._next_expiry_s = now + EXPIRY_CHECK_S
        relay = self.cfg.relay
        if self._relay_verdict is not None:
            asked, pending = self._relay_verdict
            self._relay_verdict = None
            self.routing.settle_overdue(asked, pending, now, engine, outbox)
        self.routing.expire_guests(now, relay.guest_idle_s, engine)
        if self._relay_query is not None and not self._relay_query.done():
            return  # one question at a time (a restart notice waits for the answer)
        # After a relay's start notice every request that left before it is asked
        # about at once: the new relay times none of the hand-offs sent before it
        # subscribed. (Not the later ones: its hand-off and query subscriptions run
        # apart, so a query could overtake a hand-off it is about; the relay gives a
        # later hand-off of a request it never routed back at once, RelayBooks.on_peer.
        # One sent between its subscribing and the notice's arrival may be asked about
        # and overtaken: the origin then finishes alone and the peer's late answer is
        # dropped, work lost but no wrong text.)
        assert self._link is not None
        started_at_s, self._link.relay_started_at_s = self._link.relay_started_at_s, None
        wait_s = relay.origin_wait_s if started_at_s is None else max(0.0, now - started_at_s)
        overdue = self.routing.overdue_origins(now, min(wait_s, relay.origin_wait_s))
        if overdue:
            self._relay_query = asyncio.create_task(self._ask_relay(overdue))

    async def _ask_relay(self, asked: dict[str, float]) -> None:
        """Which of these requests is the relay still timing? No answer = none."""
        try:
            reply = await self._bus.request(
                subjects.relay_query(self.cfg.namespace),
                PeerQuery(origin_instance=self.cfg.instance_id, request_ids=list(asked)),
                PEER_QUERY_REPLY_DECODER,
                timeout_s=RELAY_QUERY_TIMEOUT_S,
            )
            pending = set(reply.pending)
        except Exception as exc:
            if not (isinstance(exc, TimeoutError) or is_no_responders(exc)):
                log.warning("relay_query_failed", error=repr(exc))  # ask again later
                return
            pending = set()  # the relay is gone
        self._relay_verdict = (asked, pending)
        self._wakeup.set()

    def _steps_inline(self, is_after_idle: bool) -> bool:
        """Whether the next step runs on the event loop rather than in the thread."""
        new, cap = self._num_new_prompt_tokens, self.cfg.max_inline_step_tokens
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
        if self._inbox or self._stop.is_set():
            return
        if self._link is not None and self._link.has_messages:
            return
        timeout = self.cfg.heartbeat_interval_s if wait_s is None else wait_s
        try:
            # asyncio.timeout, not wait_for: no task per wait, one loop pass fewer to wake.
            async with asyncio.timeout(timeout):
                await self._wakeup.wait()
        except TimeoutError:
            if wait_s is None:
                self._record(samples=False)

    def _hold_s(self) -> float | None:
        """None: step now. Else how long delayed batching holds this model's step
        (asked once the engine can progress: `_loop`)."""
        if self.routing is None:
            return None
        plain = any(rid not in self.routing.requests for rid in self._runnable_ids())
        return self.routing.hold_s(time.monotonic(), plain)

    def _runnable_ids(self) -> list[str]:
        sched = self._engine.scheduler
        return [r.request_id for r in sched.running] + [r.request_id for r in sched.waiting]

    def _take_inbox(self) -> list[tuple[Dest, GatewayEvent]]:
        """Hand new requests and aborts to the engine; return the rejections to send."""
        failures: list[tuple[Dest, GatewayEvent]] = []
        while self._inbox:
            msg, link = self._inbox.popleft()
            match msg:
                case SubmitRequest():
                    failure = self._admit(msg, link)
                    if failure is not None:
                        failures.append((answer_to(msg.reply_to, link), failure))
                case AbortRequest():
                    if msg.request_id in self._owners:
                        self._engine.abort_request(msg.request_id)
        return failures

    def _admit(self, msg: SubmitRequest, link: FrameLink | None) -> RequestFailed | None:
        if self._is_draining:
            return RequestFailed(msg.request_id, 503, "the worker is shutting down; retry")
        if msg.request_id in self._owners:
            return RequestFailed(msg.request_id, 400, f"duplicate request id {msg.request_id}")
        if msg.preset is not None:
            reason = (
                f"model {msg.preset!r} is not a token-level preset here"
                if self.routing is None
                else self.routing.check_origin(msg.preset)
            )
            if reason is None and msg.params.logprobs is not None:
                # A peer's tokens come back without their logprobs.
                reason = f"logprobs are not available for the token-level preset {msg.preset!r}"
            if reason is not None:
                return RequestFailed(msg.request_id, 400, reason)
        try:
            msg.params.validate()
            if msg.predicted_output_tokens is None:
                self._engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params)
            else:
                self._engine.add_request(
                    msg.request_id,
                    msg.prompt_token_ids,
                    msg.params,
                    predicted_output_tokens=msg.predicted_output_tokens,
                )
        except ValueError as exc:  # RequestError is a ValueError: the loop goes on
            log.info("request_rejected", request_id=msg.request_id, error=str(exc))
            return RequestFailed(msg.request_id, 400, str(exc))
        # an owner that is not a valid key part is never checked (as none)
        self._owners[msg.request_id] = Owner(
            msg.reply_to,
            msg.owner if is_token(msg.owner) else "",
            link,
            answer_to(msg.reply_to, link),
        )
        self._num_new_prompt_tokens += len(msg.prompt_token_ids)
        self.num_link_requests += link is not None
        if msg.preset is not None and self.routing is not None:
            self.routing.add_origin(msg.request_id, msg.preset, msg.prompt_token_ids, msg.params)
        return None

    def _deltas(self, outputs: list[Any]) -> tuple[dict[Dest, list[GatewayEvent]], set[Dest]]:
        """A step's outputs as token deltas by destination (pacing.group's form, built in
        one pass: this runs after every step, with the caches cold from it)."""
        by_dest: dict[Dest, list[GatewayEvent]] = {}
        urgent: set[Dest] = set()
        owners = self._owners
        for out in outputs:
            owner = owners.get(out.request_id)
            if owner is None:
                continue
            dest = owner.dest
            counts = None
            if out.finished:
                del owners[out.request_id]
                if self.routing is not None:
                    counts = self.routing.final_counts.pop(out.request_id, None)
            new = out.new_token_ids  # (the engine's own lists, made for this output)
            position = out.num_output_tokens - len(new)
            top = out.new_top_logprobs
            delta = TokenDelta(
                out.request_id,
                position,
                new,
                out.new_logprobs,
                out.finish_reason if out.finished else None,
                out.num_prompt_tokens,
                counts,
                top if top and top[0] else None,
            )
            batch = by_dest.get(dest)
            if batch is None:
                by_dest[dest] = [delta]
            else:
                batch.append(delta)
            if is_urgent(delta):
                urgent.add(dest)
        return by_dest, urgent

    async def _publish(
        self,
        by_dest: dict[Dest, list[GatewayEvent]],
        urgent: Container[Dest],
        next_step_s: float | None = None,
    ) -> None:
        """One DeltaBatch per destination, with what was held for it before: written to
        its link at once (a closed link's are dropped: its requests are being aborted),
        or published over NATS. With `next_step_s` (a step expected to follow in that
        long) the pacer may hold a destination's batch for the next step's; never one
        in `urgent` (pacing.is_urgent)."""
        now = time.monotonic()
        await self._send(self._pacer.take(by_dest, urgent, now, next_step_s))

    async def _flush_held(self) -> None:
        """Write everything the pacer holds: before the loop waits (no step would), a
        step longer than the last, a drain, and in close."""
        if self._pacer:
            await self._send(self._pacer.take_all())

    async def _send(self, by_dest: dict[Dest, list[GatewayEvent]]) -> None:
        for dest, batch in by_dest.items():
            msg = DeltaBatch(instance_id=self.cfg.instance_id, step=self._num_steps, events=batch)
            if isinstance(dest, str):
                await self._bus.publish(dest, msg)
            else:
                dest.send(encode(msg))

    def _record(self, *, samples: bool) -> None:
        """Have the snapshot (and the steps' new batch samples) written in the background.

        One write runs at a time, at most one per `snapshot_interval_s` when the request
        set changed since the last write (a request arrived, finished, or moved between
        running, pending and waiting: `_request_set`), else at most one per
        `snapshot_progress_interval_s` (the same requests, further along: the estimator
        replays a snapshot forward by its age, so such a snapshot ages without
        misleading it). Steps that end while it runs or waits are folded into the next
        write, which takes the newest snapshot and every sample since: when steps
        outpace the interval (a fast model), fewer and fuller writes instead of a queue
        of stale ones, and no encoding of snapshots nobody will read. Each write costs
        the worker's core ~0.1 ms (the encoding, the Redis command, two syscalls): after
        every 1.5 ms decode step of random-tiny that is ~5% of the gateway path's token
        rate; with a write every 5 ms still ~2.5%, while the estimator reads snapshots
        every 20 ms."""
        if samples:  # (the speed observes them when they are written: fewer calls)
            self._unsent_samples.extend(self._engine.pop_batch_samples())
            del self._unsent_samples[: -self.cfg.max_batch_samples]
        if not self._record_changed and _request_set(self._engine.snapshot()) != self._written_sig:
            self._record_changed = True
            _wake(self._record_wake)
        self._record_pending = True
        if self._record_task is None or self._record_task.done():
            self._record_task = asyncio.create_task(self._write_records())

    async def _write_records(self) -> None:
        cfg = self.cfg
        while self._record_pending:
            # 1. Wait out the interval (steps ending meanwhile join this write); while
            #    only progress changed, the longer one, cut short by a change.
            interval_s = cfg.snapshot_interval_s
            if not self._record_changed and interval_s > 0:  # (0: after every iteration)
                interval_s = max(interval_s, cfg.snapshot_progress_interval_s)
            wait_s = self._last_write_s + interval_s - time.monotonic()
            if wait_s > 0 and not self._closing:
                if self._record_changed:
                    await asyncio.sleep(wait_s)
                else:
                    loop = asyncio.get_running_loop()
                    self._record_wake = wake = loop.create_future()
                    timer = loop.call_later(wait_s, _wake, wake)
                    try:
                        await wake
                    finally:
                        timer.cancel()
                        self._record_wake = None
                continue  # (a change came: its shorter interval may be over already)
            # 2. Write the newest state.
            self._last_write_s = time.monotonic()
            self._record_pending = False
            snapshot = self._engine.snapshot()
            self._written_sig, self._record_changed = _request_set(snapshot), False
            samples, self._unsent_samples = self._unsent_samples, []
            if self._speed is not None and self._calibrated is not None:
                self._speed.observe(self._calibrated, samples)
            cal = self.calibration
            if cal is not None:
                snapshot = msgspec.structs.replace(
                    snapshot,
                    batch_time_features=cal.feature_set,
                    batch_time_coefs=list(cal.coefs),
                    batch_time_speed=(
                        1.0
                        if self._speed is None or self._calibrated is None
                        else self._speed.factor(time.time())
                    ),
                )
            batch = [msgspec.msgpack.encode(s) for s in samples]
            try:
                await self._store.write_snapshot(
                    self.cfg.instance_id,
                    self._num_steps,
                    encode(snapshot),
                    ttl_s=self.cfg.snapshot_ttl_s,
                    samples=batch,
                    max_samples=self.cfg.max_batch_samples,
                )
            except Exception as exc:  # Redis hiccup: the next iteration writes again
                self._write_failures.failed(error=str(exc))
            else:
                self._write_failures.ok()

    # -- inbox, heartbeat, drain ----------------------------------------------

    async def _on_inbound(self, msg: WorkerInbound) -> None:
        self._inbox.append((msg, None))
        self._wakeup.set()

    def _on_link_inbound(self, msg: WorkerInbound, link: FrameLink) -> None:
        self._inbox.append((msg, link))
        self._wakeup.set()

    def _on_link_lost(self, link: FrameLink) -> None:
        """A gateway's link closed: abort the requests it brought (their gateway died or
        was cut off, and fails them on its side), through the inbox as a client's abort."""
        self._pacer.forget(link)
        lost = [rid for rid, owner in self._owners.items() if owner.link is link]
        # requests still in the inbox from it: admitted, then aborted right after
        lost += [
            m.request_id for m, lk in self._inbox if lk is link and isinstance(m, SubmitRequest)
        ]
        if lost:
            log.warning("gateway_link_lost", gateway=link.name, num_aborted=len(lost))
            self._inbox.extend((AbortRequest(request_id=rid), None) for rid in lost)
            self._wakeup.set()
        else:
            log.info("gateway_unlinked", gateway=link.name)

    def _info(self) -> WorkerInfo:
        return WorkerInfo(
            instance_id=self.cfg.instance_id,
            model=self.cfg.model,
            inbox=self.inbox_subject,
            max_model_len=self.cfg.instance.scheduler.max_model_len,
            max_num_seqs=self.cfg.instance.scheduler.max_num_seqs,
            started_at_s=self._started_at_s,
            heartbeat_at_s=time.time(),
            is_draining=self._is_draining,
            link_addr="" if self._links is None else self._links.addr,
            link_unix_name="" if self._links is None else self._links.unix_name,
        )

    async def _register(self) -> None:
        await self._store.register(self._info(), ttl_s=self.cfg.heartbeat_ttl_s)

    async def _heartbeat(self) -> None:
        # The loop also ends on `_closing`: redis-py can swallow a cancellation that
        # lands inside a command, and the task would then sleep on for ever.
        failures = RetryLog(log, "heartbeat_failed")
        orphan_failures = RetryLog(log, "owner_check_failed")
        while not self._closing:
            await asyncio.sleep(self.cfg.heartbeat_interval_s)
            if self._closing:
                return
            try:
                await self._register()
                await self._read_calibration()
            except Exception as exc:
                failures.failed(error=str(exc))
            else:
                failures.ok()
            try:  # on its own: a calibration that keeps failing must not stop it
                await self._abort_orphans()
            except Exception as exc:
                orphan_failures.failed(error=str(exc))
            else:
                orphan_failures.ok()

    async def _abort_orphans(self) -> None:
        """Abort the requests whose owning gateway's registration has been gone for
        ORPHAN_GRACE_TTLS heartbeat TTLs: a gateway that died leaves no one to read
        their tokens, which would otherwise run to their max_tokens. The grace covers a
        store that lost its data (a live gateway registers again within its next
        registry refresh); the abort goes through the inbox, as a client's does."""
        # A copy taken before the read: requests admitted while it is awaited wait for
        # the next check, and only the gateways asked about are judged.
        owners = {rid: o.gateway for rid, o in self._owners.items() if o.gateway}
        gids = set(owners.values())
        try:
            alive = await self._store.live_gateways(gids) if gids else set()
        except Exception:
            self._gone_since.clear()  # no stale "gone since" survives an outage of ours
            raise
        now = time.monotonic()
        # Kept: the gateways still owning requests here and still unregistered; a
        # gateway seen again, or with no request left, starts afresh next time.
        self._gone_since = {g: self._gone_since.get(g, now) for g in gids if g not in alive}
        grace_s = ORPHAN_GRACE_TTLS * self.cfg.heartbeat_ttl_s
        for gid, since in list(self._gone_since.items()):
            if now - since < grace_s:
                continue
            orphans = [rid for rid, g in owners.items() if g == gid]
            log.warning("owner_gone", gateway_id=gid, num_aborted=len(orphans))
            # an abort still queued at the next check meets a fresh grace: never twice
            self._inbox.extend((AbortRequest(request_id=rid), None) for rid in orphans)
            del self._gone_since[gid]
            self._wakeup.set()

    async def _read_calibration(self) -> None:
        blob = (await self._store.read_calibrations([self.cfg.instance_id]))[self.cfg.instance_id]
        if blob is None:
            return
        cal = CALIBRATION_DECODER.decode(blob)
        if cal != self.calibration:
            log.info(
                "calibration_applied",
                feature_set=cal.feature_set,
                mape=round(cal.mape, 4),
                num_samples=cal.num_samples,
            )
            try:
                self._calibrated = BatchTimeModel(cal.feature_set, tuple(cal.coefs))
            except ValueError as exc:  # a feature set this worker does not know: speed 1
                log.warning("calibration_unusable", error=str(exc))
                self._calibrated = None
            if self._speed is not None and self._calibrated is not None:
                # the kept iterations priced with the new model now, not at the next step
                self._speed.observe(self._calibrated, [])
        self.calibration = cal

    async def _begin_drain(self) -> float:
        """Stop accepting: re-register as draining so routers skip this instance now."""
        self._is_draining = True
        log.info(
            "drain_started", num_in_flight=len(self._owners), timeout_s=self.cfg.drain_timeout_s
        )
        try:
            await asyncio.wait_for(self._register(), 2.0)
        except Exception as exc:  # routers still notice when the registration expires
            log.warning("drain_register_failed", error=repr(exc))
        return time.monotonic() + self.cfg.drain_timeout_s

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
            num_failed_requests=len(self._owners),
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
        log.warning("drain_timeout", num_aborted=len(self._owners))
        return self._fail_all(503, reason)

    def _fail_all(self, status: int, reason: str) -> list[tuple[Dest, GatewayEvent]]:
        """Abort every request this worker holds (their KV is freed at the next step);
        return the failures to send their gateways."""
        failures: list[tuple[Dest, GatewayEvent]] = []
        for request_id, owner in self._owners.items():
            self._engine.abort_request(request_id)
            failures.append((owner.dest, RequestFailed(request_id, status, reason)))
        self._owners.clear()
        return failures
