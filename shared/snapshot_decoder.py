"""Stored snapshot blobs read back as `WorkloadSnapshot`s, with one warning per
instance per stretch of undecodable ones."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from shared.scheduling.snapshot import WorkloadSnapshot
from shared.store import VersionedBlob


class SnapshotDecoder:
    """Read snapshots to `WorkloadSnapshot`s, for the readers that only count requests
    (the gateway's metrics, the relay's load) and for the estimator: a blob that does
    not decode (another writer's layout, a corrupt one) reads as missing, with one
    warning per instance per bad stretch."""

    def __init__(self, log: Any) -> None:
        self._log = log  # the reader's structlog logger
        self._decoder = msgspec.msgpack.Decoder(WorkloadSnapshot)
        self._errors: dict[str, str] = {}  # instance -> why its latest blob did not decode

    def decode_one(self, instance_id: str, data: bytes) -> WorkloadSnapshot | None:
        """The snapshot, or None (warned on the first failure of a bad stretch)."""
        try:
            snapshot = self._decoder.decode(data)
        except msgspec.DecodeError as exc:
            if instance_id not in self._errors:
                self._log.warning("snapshot_undecodable", instance_id=instance_id, error=str(exc))
            self._errors[instance_id] = str(exc)
            return None
        self._errors.pop(instance_id, None)
        return snapshot

    def decode(self, blobs: Mapping[str, VersionedBlob | None]) -> dict[str, WorkloadSnapshot]:
        """Every blob that decodes, by instance."""
        out: dict[str, WorkloadSnapshot] = {}
        for iid, blob in blobs.items():
            if blob is not None and (snap := self.decode_one(iid, blob.data)) is not None:
                out[iid] = snap
        return out

    @property
    def undecodable(self) -> frozenset[str]:
        """Instances whose latest blob did not decode."""
        return frozenset(self._errors)

    def error(self, instance_id: str) -> str:
        """Why the instance's latest blob did not decode ("" if it did)."""
        return self._errors.get(instance_id, "")

    def keep_only(self, live: Iterable[str]) -> None:
        """Forget instances that left (a returning one warns afresh)."""
        for gone in set(self._errors).difference(live):
            del self._errors[gone]
