"""Per-request outcome: raw counters and timestamps, derived latencies as properties."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from loadgen.workloads import RequestSpec


class Status(enum.StrEnum):
    """How a request ended."""

    PENDING = "pending"
    OK = "ok"
    HTTP_ERROR = "http_error"  # 4xx/5xx status
    STREAM_ERROR = "stream_error"  # error event, bad JSON or a stream cut short
    TIMEOUT = "timeout"
    CONNECT_ERROR = "connect_error"  # refused, reset, DNS
    CANCELLED = "cancelled"  # still running when the run ended


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it. Times are ns since the run's origin."""

    spec: RequestSpec
    scheduled_ns: int  # when the arrival process wanted it sent
    dispatched_ns: int = 0  # when the scheduler got to it (lag = dispatched - scheduled)
    start_ns: int = 0  # when it was sent (after waiting for a --max-concurrency slot)
    first_token_ns: int = 0  # first chunk with content
    end_ns: int = 0
    chunk_ns: list[int] = field(default_factory=list)  # arrival of every content chunk
    status: Status = Status.PENDING
    http_status: int = 0
    error: str = ""
    # from the server's `usage`, when sent
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    request_id: str = ""  # the x-request-id loadgen sent
    server_request_id: str = ""  # the server's: X-Request-Id response header, else the body's `id`
    # Baton's per-response fields, when present
    served_model: str = ""  # `model` of the response, or `baton.model`
    instance: str = ""  # X-Instance-Id response header, or `baton.instance`
    tokens_per_model: dict[str, int] = field(default_factory=dict)
    policy: str = ""  # `baton.policy`: the routing policy that chose the instance
    router_overhead_ms: float | None = None  # `baton.router_overhead_ms`
    predicted_ttft_ms: float | None = None  # `baton.predicted_ttft_ms`: the router's estimate
    cost: float | None = None
    has_baton: bool = False  # the response carried a `baton` object
    finish_reason: str = ""
    text: str = ""

    @property
    def is_ok(self) -> bool:
        return self.status is Status.OK

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_ns)

    @property
    def input_tokens(self) -> int:
        """Server-counted prompt tokens if reported, else the estimate."""
        return self.prompt_tokens if self.prompt_tokens is not None else self.spec.input_tokens

    @property
    def output_tokens(self) -> int:
        """Server-counted completion tokens if reported, else content chunks."""
        return self.completion_tokens if self.completion_tokens is not None else self.num_chunks

    @property
    def queue_s(self) -> float:
        """Wait for a concurrency slot."""
        return (self.start_ns - self.dispatched_ns) / 1e9

    @property
    def lag_s(self) -> float:
        """How late the scheduler dispatched it."""
        return (self.dispatched_ns - self.scheduled_ns) / 1e9

    @property
    def ttft_s(self) -> float | None:
        if not self.is_ok or not self.first_token_ns:
            return None
        return (self.first_token_ns - self.start_ns) / 1e9

    @property
    def e2el_s(self) -> float | None:
        return (self.end_ns - self.start_ns) / 1e9 if self.is_ok else None

    @property
    def tpot_s(self) -> float | None:
        """(E2EL - TTFT) / (output tokens - 1), as `vllm bench serve` defines it."""
        ttft, e2el = self.ttft_s, self.e2el_s
        if ttft is None or e2el is None or self.output_tokens < 2:
            return None
        return (e2el - ttft) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        """Gaps between consecutive content chunks."""
        if not self.is_ok:
            return []
        return [(b - a) / 1e9 for a, b in itertools.pairwise(self.chunk_ns)]

    @property
    def met_slo(self) -> bool | None:
        """TTFT within the request's target; None without a target; failures miss."""
        if self.spec.slo_ttft_ms is None:
            return None
        ttft = self.ttft_s
        return ttft is not None and ttft * 1000.0 <= self.spec.slo_ttft_ms

    @property
    def model_for_utility(self) -> str:
        """The model that served it if known, else the one asked for."""
        return self.served_model or self.spec.model

    def to_detail(self, origin_epoch_ns: int) -> dict[str, Any]:
        """One JSONL line of --save-detailed: epoch ns timestamps, lengths, outcome."""

        def epoch(ns: int) -> int | None:
            return origin_epoch_ns + ns if ns else None

        return {
            "index": self.spec.index,
            "request_id": self.request_id or None,
            "server_request_id": self.server_request_id or None,
            "task": self.spec.task,
            "label": self.spec.label or None,
            "model": self.spec.model,
            "status": str(self.status),
            "http_status": self.http_status or None,
            "error": self.error or None,
            "scheduled_ns": origin_epoch_ns + self.scheduled_ns,
            "dispatched_ns": epoch(self.dispatched_ns),
            "start_ns": epoch(self.start_ns),
            "first_token_ns": epoch(self.first_token_ns),
            "end_ns": epoch(self.end_ns),
            "schedule_lag_ms": self.lag_s * 1000.0 if self.dispatched_ns else None,
            "queue_ms": self.queue_s * 1000.0 if self.start_ns else None,
            "ttft_ms": _ms(self.ttft_s),
            "tpot_ms": _ms(self.tpot_s),
            "e2el_ms": _ms(self.e2el_s),
            "itls_ms": [x * 1000.0 for x in self.itls_s],
            "input_tokens_est": self.spec.input_tokens,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.spec.max_tokens,
            "completion_tokens": self.completion_tokens,
            "num_chunks": self.num_chunks,
            "output_tokens": self.output_tokens,
            "finish_reason": self.finish_reason or None,
            "slo_ttft_ms": self.spec.slo_ttft_ms,
            "met_slo": self.met_slo,
            "budget": self.spec.budget,
            "served_model": self.served_model or None,
            "instance": self.instance or None,
            "tokens_per_model": self.tokens_per_model or None,
            "policy": self.policy or None,
            "router_overhead_ms": self.router_overhead_ms,
            "predicted_ttft_ms": self.predicted_ttft_ms,
            "cost": self.cost,
            "text": self.text or None,  # only with --keep-text
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0
