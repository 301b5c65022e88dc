"""Worker registration, stored in Redis under `keys.worker` with a TTL.

A worker rewrites its record every heartbeat interval; when it dies the key
expires and gateways and estimators stop seeing it.
"""

from __future__ import annotations

import msgspec


class WorkerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a gateway or estimator needs to know about a live instance."""

    instance_id: str  # unique per worker process
    model: str  # real model name it serves (a key of the cluster file's [models])
    inbox: str  # subject it takes SubmitRequest/AbortRequest on
    max_model_len: int  # tokens, prompt + output
    max_num_seqs: int  # requests it runs at once
    started_at_s: float  # wall clock (time.time()) when the process started
    heartbeat_at_s: float  # wall clock of this record
    is_draining: bool = False  # stopping: route nothing new here


WORKER_INFO_DECODER = msgspec.msgpack.Decoder(WorkerInfo)


def departed(before: dict[str, WorkerInfo], now: dict[str, WorkerInfo]) -> list[str]:
    """Instances that left: expired, or restarted under the same id (their requests died with them)."""
    return [
        iid
        for iid, info in before.items()
        if iid not in now or now[iid].started_at_s != info.started_at_s
    ]
