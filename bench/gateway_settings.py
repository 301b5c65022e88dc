"""What one gateway benchmark run measures with, and where its processes run."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

# the benchmark's chat prompts: the i-th request of either side sends PROMPTS[i % 8]
PROMPTS = (
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about autumn leaves.",
    "What is the capital of France, and why is it famous?",
    "Give three tips for learning a new language.",
    "Describe a cat to someone who has never seen one.",
    "Summarize the plot of Romeo and Juliet.",
    "List four prime numbers and explain what makes them prime.",
    "How does a bicycle stay upright?",
)


def prompt(i: int) -> str:
    return PROMPTS[i % len(PROMPTS)]


@dataclass(frozen=True)
class Settings:
    """A run's settings (scripts/bench_gateway.py's flags of the same names)."""

    model: str = "random-tiny"
    dtype: str = "float32"
    client: str = "aiohttp"  # the HTTP client (bench.gateway_client.CLIENTS)
    streams: int = 16  # concurrent streams of a throughput round
    new_tokens: int = 128  # tokens per stream
    ttft_requests: int = 50
    ttft_tokens: int = 2  # tokens per TTFT request
    idle_ms: float = 50.0  # idle gap before every TTFT request on both sides
    num_kv_blocks: int = 1024
    rounds: int = 24  # alternating engine/gateway throughput rounds
    breakdown: bool = False
    worker: tuple[str, ...] = ()  # [worker] settings of the cluster file, "key=value"
    worker_cpus: list[int] = field(default_factory=list)  # cpu_layout's
    rest_cpus: list[int] = field(default_factory=list)

    @property
    def max_num_seqs(self) -> int:
        """Both engines' batch limit: every stream of a round in one batch."""
        return max(16, self.streams)


def cpu_layout(mode: str) -> tuple[list[int], list[int]]:
    """(the worker's CPUs, everyone else's) for --cpus; ([], []): no pinning.

    auto, with two CPUs or more: the worker on the last one alone (and the in-process
    engine when it runs: EngineSide), the gateway, the estimator, NATS, Redis and this
    process (the client, the anchors' servers) on the others, as a deployment that
    pins its workers runs them (shared.runtime.pin_cpus)."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if mode == "none" or len(allowed) < 2:
        return [], []
    return allowed[-1:], allowed[:-1]
