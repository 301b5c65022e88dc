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

from shared.subjects import check_token


def workers(namespace: str) -> str:
    return f"{check_token(namespace)}:workers"


def registry_epoch(namespace: str) -> str:
    return f"{check_token(namespace)}:registry_epoch"


def worker(namespace: str, instance_id: str) -> str:
    return f"{check_token(namespace)}:worker:{check_token(instance_id)}"


def gateway(namespace: str, gateway_id: str) -> str:
    return f"{check_token(namespace)}:gateway:{check_token(gateway_id)}"


def snapshot(namespace: str, instance_id: str) -> str:
    return f"{check_token(namespace)}:snapshot:{check_token(instance_id)}"


def batch_samples(namespace: str, instance_id: str) -> str:
    return f"{check_token(namespace)}:samples:{check_token(instance_id)}"


def calibration(namespace: str, instance_id: str) -> str:
    return f"{check_token(namespace)}:calibration:{check_token(instance_id)}"


def batch_tables(namespace: str, preset: str) -> str:
    return f"{check_token(namespace)}:batch_tables:{check_token(preset)}"


def ledger(namespace: str, instance_id: str) -> str:
    return f"{check_token(namespace)}:ledger:{check_token(instance_id)}"
