"""A request the gateway has parsed, checked and tokenized: what routing, submission and
the answer's generation read (preparation.py builds it)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from shared.sampling import SamplingParams


@dataclass
class Prepared:
    """A validated request, ready to route."""

    request_id: str
    is_chat: bool
    body: ChatCompletionRequest | CompletionRequest
    prompt_token_ids: list[int]
    params: SamplingParams
    tokenizer: Any
    ttft_target_ms: float | None = None  # x-slo-ttft-ms
    task: str | None = None  # x-baton-task
    policy: str | None = None  # x-baton-policy
    weights: list[float] | None = None  # x-baton-weights
    budget: float | None = None  # x-baton-budget, cost units
    arrival_time_s: float = field(default_factory=time.time)
    t0: float = field(default_factory=time.perf_counter)
