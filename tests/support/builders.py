"""Registry records as workers write them, for tests that play the registry by hand."""

from __future__ import annotations

from shared import subjects
from shared.messages.registry import WorkerInfo


def worker_info(
    instance_id: str,
    model: str = "m",
    *,
    namespace: str = "ns",
    max_model_len: int = 4096,
    max_num_seqs: int = 4,
    at_s: float = 0.0,
) -> WorkerInfo:
    """A live, non-draining worker of `model` whose inbox is its real subject in
    `namespace`; started and last heard of at `at_s` (the worker's clock)."""
    return WorkerInfo(
        instance_id=instance_id,
        model=model,
        inbox=subjects.worker_inbox(namespace, instance_id),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        started_at_s=at_s,
        heartbeat_at_s=at_s,
    )
