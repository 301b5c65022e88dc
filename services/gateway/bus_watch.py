"""Whether NATS, and the token-routing relay behind it, answer: read by /health.

A hung NATS server (a stopped process, a full disk) keeps its connections open, so
`bus.is_connected` stays true until nats-py's own pings (every 2 minutes) give up;
meanwhile routing's and token routing's messages stall while plain requests still go
over the workers' direct links. A hung relay stalls every token-routed request until
the workers' `origin_wait_s`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from shared import subjects
from shared.bus import Bus, is_no_responders
from shared.logging import RetryLog, get_logger
from shared.messages.health import HEALTH_REPLY_DECODER, HealthProbe

log = get_logger(component="gateway")
CHECK_S = 2.0  # how often NATS is pinged
# a ping unanswered this long, seconds (nats-py takes whole ones): NATS is unresponsive
PING_TIMEOUT_S = 1


class BusWatch:
    """Pings NATS every CHECK_S; where a preset routes per token, probes the relay too."""

    def __init__(self, bus: Bus, namespace: str, sender: str, *, has_relay: bool) -> None:
        self._bus = bus
        self._relay_subject = subjects.health(namespace, "relay")
        self._sender = sender
        self.is_bus_responsive = True  # NATS answered the last ping
        # The relay's answer to the last probe: "ok", "unresponsive" (it hangs: routed
        # requests stall), "down" (none subscribed: the launcher restarts it), "unknown"
        # (not asked yet); None: no preset routes per token, none asked.
        self.relay_state: str | None = "unknown" if has_relay else None

    async def run(self, is_closing: Callable[[], bool]) -> None:
        failures = RetryLog(log, "nats_unresponsive", recovered="nats_responsive")
        while not is_closing():
            if not self._bus.is_connected:
                await asyncio.sleep(CHECK_S)
                continue  # (reconnecting: /health says so already)
            try:
                await self._bus.flush(timeout_s=PING_TIMEOUT_S)
            except Exception as exc:
                if is_closing():
                    return
                self.is_bus_responsive = False
                failures.failed(error=type(exc).__name__)
            else:
                self.is_bus_responsive = True
                failures.ok()
                if self.relay_state is not None:
                    self.relay_state = await self._probe_relay()
            await asyncio.sleep(CHECK_S)  # (the first check at start: no "unknown" then)

    async def _probe_relay(self) -> str:
        try:
            await self._bus.request(
                self._relay_subject,
                HealthProbe(sender=self._sender),
                HEALTH_REPLY_DECODER,
                timeout_s=PING_TIMEOUT_S,
            )
        except Exception as exc:
            return "down" if is_no_responders(exc) else "unresponsive"
        return "ok"
