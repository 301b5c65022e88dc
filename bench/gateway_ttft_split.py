"""The gateway TTFT taken apart: by the gateway's own stamps (ServerSplit), and at the
two NATS crossings by a passive subscriber (PathObserver, --breakdown)."""

from __future__ import annotations

import time
from typing import Any

from bench.gateway_stats import p50_by_name


class ServerSplit:
    """The gateway's own account of each TTFT request, from the `baton` object of its
    last chunk: `prepare_ms` (parse, chat template, tokenize), `router_overhead_ms` and
    `first_token_ms` (submit -> first token at the gateway: the crossings to the worker
    and back, its wake-up and the prefill step). What the client waited beyond them is
    HTTP both ways, the handler's start and the first chunk's SSE framing."""

    FIELDS = ("prepare_ms", "router_overhead_ms", "first_token_ms")
    NAMES = ("http_and_sse", "prepare", "route", "submit_to_first_token")

    def __init__(self) -> None:
        self.rows: list[tuple[float, ...]] = []

    def record(self, ttft_s: float, baton: dict[str, Any] | None) -> None:
        values = [None if baton is None else baton.get(f) for f in self.FIELDS]
        parts = [float(v) for v in values if isinstance(v, int | float)]
        if len(parts) == len(values):
            self.rows.append((1e3 * ttft_s - sum(parts), *parts))

    def summary(self) -> dict[str, float]:
        """p50 of each part, ms (empty without rows)."""
        return p50_by_name(self.rows, self.NAMES)


class PathObserver:
    """A passive NATS subscriber on the worker's and the gateway's inboxes (namespace
    `namespace`).

    It timestamps (in this process, on the same clock as the client) when each
    request's SubmitRequest crosses the bus and when its first token's DeltaBatch
    does, splitting the gateway-path TTFT into
      http->submit   HTTP parse, tokenize, route, publish + one NATS hop
      worker         NATS hop, worker wake-up, add_request, prefill step, publish
      delta->sse     NATS hop, gateway merge, detokenize, SSE chunk, HTTP to the client
    (each of the two bus crossings also pays this observer's own hop, equally). Only
    requests that cross NATS count: by default they take the gateway's direct link to
    the worker (shared/link.py).
    """

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.submit_at: dict[str, float] = {}
        self.first_delta_at: dict[str, float] = {}
        self.rows: list[tuple[float, float, float]] = []
        self._nc: Any = None

    async def start(self, nats_url: str) -> None:
        import nats

        from shared.messages.gateway import DELTA_BATCH_DECODER, TokenDelta
        from shared.messages.worker import WORKER_INBOUND_DECODER, SubmitRequest

        async def on_submit(msg: Any) -> None:
            now = time.perf_counter()
            inbound = WORKER_INBOUND_DECODER.decode(msg.data)
            if isinstance(inbound, SubmitRequest):
                self.submit_at[inbound.request_id] = now

        async def on_delta(msg: Any) -> None:
            now = time.perf_counter()
            for ev in DELTA_BATCH_DECODER.decode(msg.data).events:
                if isinstance(ev, TokenDelta) and ev.token_ids:
                    self.first_delta_at.setdefault(ev.request_id, now)

        nc = await nats.connect(nats_url)
        await nc.subscribe(f"{self.namespace}.worker.*.in", cb=on_submit)
        await nc.subscribe(f"{self.namespace}.gateway.*.in", cb=on_delta)
        await nc.flush()
        self._nc = nc

    def record(self, request_id: str, t0: float, t_first: float) -> None:
        sub, delta = self.submit_at.pop(request_id, None), self.first_delta_at.pop(request_id, None)
        if sub is not None and delta is not None:
            self.rows.append((1e3 * (sub - t0), 1e3 * (delta - sub), 1e3 * (t_first - delta)))

    def summary(self) -> dict[str, float]:
        return p50_by_name(self.rows, ("http_to_submit", "worker", "delta_to_sse"))

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.close()
