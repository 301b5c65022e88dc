"""Worker registration, stored in Redis under `keys.worker` with a TTL.

A worker rewrites its record every heartbeat interval; when it dies the key
expires and gateways and estimators stop seeing it.

A store that loses its data (a Redis restart, a failover to a replica that lagged)
loses every record at once while the workers live on; each registers again at its
next heartbeat. Read naively, every worker would leave and come back, and readers
would fail the requests they stream meanwhile. So the first registration sets a
random registry epoch (`keys.registry_epoch`), and a reader that sees it change
keeps every worker it knew for one heartbeat TTL (`RegistryEpoch`), however long
the store was unreachable before.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

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
    # host:port of its direct link (shared/link.py): gateways send it requests there and
    # get their tokens back the same way; "": NATS only ([worker] link = false)
    link_addr: str = ""
    # the same link's abstract Unix socket name (Linux; without its leading NUL), which
    # gateways in the worker's network namespace dial first; "": TCP only
    link_unix_name: str = ""


WORKER_INFO_DECODER = msgspec.msgpack.Decoder(WorkerInfo)


def departed(before: dict[str, WorkerInfo], now: dict[str, WorkerInfo]) -> list[str]:
    """Instances that left: expired, or restarted under the same id (their requests died with them)."""
    return [
        iid
        for iid, info in before.items()
        if iid not in now or now[iid].started_at_s != info.started_at_s
    ]


class RegistryEpoch:
    """What one reader saw of the registry epoch (module docstring): `carry` keeps the
    workers a read lacks while the store has just lost its data."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s  # the workers' heartbeat TTL
        self._epoch: str | None = None
        self._lost_at_s = -math.inf  # time.monotonic() when the epoch last changed

    def carry(
        self,
        before: dict[str, WorkerInfo],
        read: Iterable[WorkerInfo],
        epoch: str | None,
        now_s: float,
    ) -> dict[str, WorkerInfo]:
        """The workers to treat as live after a read (`Store.read_registry`; `now_s`:
        time.monotonic()): the read's, plus, for `ttl_s` after the epoch changed, each
        worker of `before` the read lacks, as last read (a live one registers again
        within a heartbeat; one that died meanwhile leaves when the window ends).
        Outside that window a worker the read lacks is gone at once (`departed`)."""
        live = {w.instance_id: w for w in read}
        if self._epoch is not None and epoch != self._epoch:
            self._lost_at_s = now_s
        self._epoch = epoch
        if now_s - self._lost_at_s < self.ttl_s:
            for iid, info in before.items():
                live.setdefault(iid, info)
        return live
