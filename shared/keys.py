"""Every Redis key Baton uses, built in one place, prefixed by the deployment namespace.

{ns}:workers                    SET of instance ids ever registered (pruned by readers)
{ns}:registry_epoch             a random id set once (SET NX) by the first registration: a new
                                one tells readers the store lost its data (shared.messages.registry)
{ns}:worker:{instance_id}       registration (WorkerInfo, msgpack), expires unless heartbeats renew it
{ns}:gateway:{gateway_id}       a gateway's liveness ("1"), renewed every registry refresh: workers
                                abort the requests of a gateway that is gone
{ns}:snapshot:{instance_id}     STRING: the latest WorkloadSnapshot as a VersionedBlob, a 16-byte
                                header (version int64, wall_time_s float64, little-endian) and
                                the msgpack snapshot (shared.store), expires unless rewritten
{ns}:samples:{instance_id}      LIST of BatchSample (msgpack), newest last, capped
{ns}:calibration:{instance_id}  BatchTimeCalibration (msgpack): the estimator's fitted batch-time model
{ns}:batch_tables:{preset}      BatchTables (msgpack): the batcher's latest B* tables for a preset
{ns}:ledger:{instance_id}       HASH request id -> LedgerEntry (msgpack): the estimators' shared ledger
"""

from __future__ import annotations

from collections.abc import Callable

from shared.subjects import check_token


def _global(name: str) -> Callable[[str], str]:
    def key(namespace: str) -> str:
        return f"{check_token(namespace)}:{name}"

    return key


def _per_id(name: str) -> Callable[[str, str], str]:
    """The key of one instance's (gateway's, preset's) `name` in a namespace."""

    def key(namespace: str, ident: str) -> str:
        return f"{check_token(namespace)}:{name}:{check_token(ident)}"

    return key


# The module docstring lists each key's type and content.
workers = _global("workers")
registry_epoch = _global("registry_epoch")
worker = _per_id("worker")
gateway = _per_id("gateway")
snapshot = _per_id("snapshot")
batch_samples = _per_id("samples")
calibration = _per_id("calibration")
batch_tables = _per_id("batch_tables")
ledger = _per_id("ledger")
