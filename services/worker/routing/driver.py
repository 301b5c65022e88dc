"""Token-level routing on one worker, as its step loop drives it.

The runtime (runtime.TokenRouting: hand-offs, guests; hold.py, silence.py) and its bus
side (link.RoutingLink: messages to and from the relay and the batcher) meet the
loop here, between steps and after each step, with the safety nets for a relay that
is itself gone:
  * an origin whose request has been away `origin_wait_s` asks the relay about it
    (in the background; the answer is applied between steps) and, unless the relay
    still times that hand-off, takes it back and finishes alone;
  * a peer copy that no visit touched for `guest_idle_s` is dropped;
  * after a relay's start notice every request that left before it is asked about
    at once: the new relay times none of the hand-offs sent before it subscribed.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from services.worker.routing import silence
from services.worker.routing.chars import CharBoundaries
from services.worker.routing.link import RoutingLink
from services.worker.routing.runtime import TokenRouting
from services.worker.routing.tracked import Outbox
from shared import subjects
from shared.bus import Bus, is_no_responders
from shared.logging import get_logger
from shared.messages.peer import PEER_QUERY_REPLY_DECODER, PeerQuery
from shared.store import Store

if TYPE_CHECKING:
    from services.worker.config import WorkerServiceConfig
    from services.worker.engine.outputs import RequestOutput
    from services.worker.engine.protocol import RoutableEngine

log = get_logger(component="worker")
EXPIRY_CHECK_S = 0.5  # how often parked token-routing requests are checked for silence
RELAY_QUERY_TIMEOUT_S = 1.0  # a relay that does not answer within this is taken as gone


class RoutingDriver:
    """One worker's token-level routing: `start`, then `between_steps` and `after_step`
    from the loop, `hold_s` before a step, `close` at the end."""

    def __init__(
        self,
        cfg: WorkerServiceConfig,
        bus: Bus,
        engine: RoutableEngine,
        routing: TokenRouting,
        link: RoutingLink,
        wakeup: asyncio.Event,
    ) -> None:
        self.cfg = cfg
        self._bus = bus
        self._wakeup = wakeup  # the loop's: set when the relay's answer is in
        self.engine = engine
        self.routing = routing
        self.link = link
        self._next_expiry_s = 0.0  # monotonic time of the next relay-silence check
        self._relay_query: asyncio.Task[None] | None = None  # a PeerQuery in flight
        # the relay's answer, applied by the loop: (asked ids with the time their
        # hand-off left, ids it still times)
        self._relay_verdict: tuple[dict[str, float], set[str]] | None = None

    @classmethod
    async def start(
        cls,
        cfg: WorkerServiceConfig,
        bus: Bus,
        store: Store,
        engine: RoutableEngine,
        wakeup: asyncio.Event,
        serving: tuple[str | None, str | None],
    ) -> RoutingDriver:
        """Build the presets' policies, hook them into the engine and subscribe.
        `serving`: the engine's (dtype, weight_dtype), for the routers' check."""
        from services.worker.routing.policies import create_token_policy

        routing = TokenRouting(
            cfg.instance_id,
            cfg.model,
            cfg.token_presets,
            lambda name, models, index, args: create_token_policy(name, models, index, args),
            _char_boundaries(engine, cfg.model),
        )
        engine.hook = routing.hook
        link = RoutingLink(routing, bus, store, cfg.namespace, wakeup, cfg.relay.stats_interval_s)
        await link.start()
        log.info("token_routing_ready", presets=sorted(routing.policies))
        _warn_on_router_dtype(cfg.model, routing, serving)
        return cls(cfg, bus, engine, routing, link, wakeup)

    @property
    def has_messages(self) -> bool:
        return self.link.has_messages

    async def between_steps(self, outbox: Outbox) -> bool:
        """Apply the peers' messages (start, resume or release copies) and the relay's
        safety nets, send what they produced; True when peer work was applied (a
        copy brings a sequence the prompt count misses: the next step runs in the
        thread)."""
        had_messages = self.link.has_messages
        self.link.apply(self.engine, outbox)
        if (
            self.link.relay_started_at_s is not None
            or self._relay_verdict is not None
            or time.monotonic() >= self._next_expiry_s
        ):
            self._check_relay_silence(outbox)
        await self.link.publish(outbox)
        return had_messages

    async def after_step(
        self, outputs: list[RequestOutput], step_s: float, outbox: Outbox
    ) -> list[RequestOutput]:
        """A step's outputs through the policies: hand-offs leave, peers' copies answer;
        returns the outputs the worker's own requests' owners see."""
        routing, engine = self.routing, self.engine
        routing.record_step(step_s)
        outputs = routing.on_outputs(outputs, outbox)
        routing.on_handoffs(engine.pop_handoffs(), engine, outbox)
        await self.link.publish(outbox)
        await self.link.maybe_send_stats()
        return outputs

    def hold_s(self) -> float | None:
        """None: step now. Else how long delayed batching holds this model's step."""
        sched = self.engine.scheduler
        requests = self.routing.requests
        plain = any(r.request_id not in requests for r in sched.running) or any(
            r.request_id not in requests for r in sched.waiting
        )
        return self.routing.hold_s(time.monotonic(), plain)

    def close(self) -> None:
        if self._relay_query is not None:
            self._relay_query.cancel()  # its answer has nobody left to apply it

    def _check_relay_silence(self, outbox: Outbox) -> None:
        """Apply the relay's last answer about overdue requests, ask it about the ones
        overdue now, and drop long-idle peer copies (module docstring)."""
        now = time.monotonic()
        self._next_expiry_s = now + EXPIRY_CHECK_S
        relay, routing, engine = self.cfg.relay, self.routing, self.engine
        if self._relay_verdict is not None:
            asked, pending = self._relay_verdict
            self._relay_verdict = None
            silence.settle_overdue(routing, asked, pending, now, engine, outbox)
        silence.expire_guests(routing, now, relay.guest_idle_s, engine)
        if self._relay_query is not None and not self._relay_query.done():
            return  # one question at a time (a restart notice waits for the answer)
        # Not the hand-offs sent after a restart notice: the relay's hand-off and query
        # subscriptions run apart, so a query could overtake a hand-off it is about;
        # the relay gives a later hand-off of a request it never routed back at once
        # (RelayBooks.on_peer). One sent between its subscribing and the notice's
        # arrival may be asked about and overtaken: the origin then finishes alone and
        # the peer's late answer is dropped, work lost but no wrong text.
        started_at_s, self.link.relay_started_at_s = self.link.relay_started_at_s, None
        wait_s = relay.origin_wait_s if started_at_s is None else max(0.0, now - started_at_s)
        overdue = silence.overdue_origins(routing, now, min(wait_s, relay.origin_wait_s))
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


def _char_boundaries(engine: RoutableEngine, model: str) -> CharBoundaries | None:
    """The model's vocabulary, for hand-offs to wait for a character's end (chars.py);
    None, with a warning, when its tokenizer cannot load."""
    try:
        return CharBoundaries(engine.tokenizer().token_bytes)
    except Exception as exc:  # (the hand-offs go on, characters unguarded)
        log.warning("token_bytes_unavailable", model=model, error=repr(exc))
        return None


def _warn_on_router_dtype(
    model: str, routing: TokenRouting, serving: tuple[str | None, str | None]
) -> None:
    """A router reads this engine's hidden states; its threshold was set on another
    numeric's (close, not equal): say so rather than drift quietly."""
    for preset, policy in routing.policies.items():
        meta = getattr(policy, "meta", {})
        # routers from before weight_dtype held their weights in the compute dtype
        trained = (meta.get("dtype"), meta.get("weight_dtype", meta.get("dtype")))
        reads_here = meta.get("small_model", model) == model
        if reads_here and None not in trained and None not in serving and trained != serving:
            log.warning(
                "router_dtype_differs",
                preset=preset,
                trained_on={"dtype": trained[0], "weight_dtype": trained[1]},
                serving={"dtype": serving[0], "weight_dtype": serving[1]},
                fix=f"set dtype = {trained[0]!r} for {model} in the cluster "
                f"file, or rebuild the routers with `just routers --dtype {serving[0]}` "
                "on a machine that serves them alike",
            )
