"""Requests the estimators dispatched that no snapshot shows yet.

Between a routing decision and the first snapshot that contains the request,
the chosen instance looks no busier than before; without the ledger a burst of
requests would all herd onto the instance that looked emptiest. An entry leaves
the ledger when a snapshot of its instance lists the request id, when the
request ends (RequestDoneEvent), or after `ttl_s` (a lost event must not
inflate an instance's load for ever).

Several estimator replicas (one queue group on the route subject) each see only
the requests they routed themselves, so a burst split between them herds again.
`SharedLedger` shares the entries through Redis (`shared.store`, one hash per
instance of request id -> msgpack LedgerEntry) without touching the decision path:

    decision:          local Ledger.add + queue the entry for the writer (no I/O)
    writer task:       queued entries -> HSET (one pipeline per wake-up); ids this
                       replica dropped -> HDEL
    background refresh: the hashes are read with the snapshots (same round trip)
                       and merged: an id not yet known, not shown by the snapshot,
                       not dropped here before, not expired -> added; another
                       replica's entry gone from Redis -> dropped here too

Dropped ids are remembered for `ttl_s` (tombstones), so an entry read back from
Redis after its RequestDoneEvent is not re-added. Times are wall-clock
(time.time()): entries are compared across processes and with snapshot times.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet

import msgspec


class LedgerEntry(msgspec.Struct, frozen=True, array_like=True):
    """One dispatched request (stored in Redis by the shared ledger, msgpack)."""

    request_id: str
    instance_id: str
    num_prompt_tokens: int  # tokens
    max_tokens: int  # tokens
    dispatched_at_s: float  # time.time() of the decision (wall clock: shared, vs snapshots)
    predicted_output_tokens: int | None = None  # tokens, the length the decision assumed


LEDGER_ENTRY_ENCODER = msgspec.msgpack.Encoder()
LEDGER_ENTRY_DECODER = msgspec.msgpack.Decoder(LedgerEntry)


class Ledger:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._entries: dict[str, LedgerEntry] = {}
        self._by_instance: dict[str, dict[str, LedgerEntry]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def get(self, request_id: str) -> LedgerEntry | None:
        return self._entries.get(request_id)

    def add(self, entry: LedgerEntry) -> None:
        self.remove(entry.request_id)
        self._entries[entry.request_id] = entry
        self._by_instance.setdefault(entry.instance_id, {})[entry.request_id] = entry

    def remove(self, request_id: str) -> bool:
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return False
        del self._by_instance[entry.instance_id][request_id]
        return True

    def reconcile(self, instance_id: str, visible_ids: AbstractSet[str]) -> int:
        """Drop entries of `instance_id` that its snapshot now shows. Returns how many."""
        return len(self.reconcile_ids(instance_id, visible_ids))

    def reconcile_ids(self, instance_id: str, visible_ids: AbstractSet[str]) -> list[str]:
        """As `reconcile`, returning the dropped ids."""
        pending = self._by_instance.get(instance_id)
        if not pending:
            return []
        seen = [rid for rid in pending if rid in visible_ids]
        for rid in seen:
            self.remove(rid)
        return seen

    def pending(self, instance_id: str) -> list[LedgerEntry]:
        """Dispatched to `instance_id`, not yet visible in its snapshot."""
        return list(self._by_instance.get(instance_id, {}).values())

    def expire(self, now_s: float) -> int:
        return len(self.expire_entries(now_s))

    def expire_entries(self, now_s: float) -> list[LedgerEntry]:
        """Drop entries older than ttl_s; returns them."""
        old = [e for e in self._entries.values() if now_s - e.dispatched_at_s > self.ttl_s]
        for e in old:
            self.remove(e.request_id)
        return old

    def forget_instance(self, instance_id: str) -> None:
        for rid in list(self._by_instance.pop(instance_id, {})):
            self._entries.pop(rid, None)


class SharedLedger:
    """A local Ledger kept in step with the other replicas' through Redis (module docstring).

    Pure bookkeeping: the service moves `take_writes()` to Redis and feeds `merge()`
    what it read. Decisions read `ledger` as before.
    """

    def __init__(self, ttl_s: float) -> None:
        self.ledger = Ledger(ttl_s)
        self._adds: list[LedgerEntry] = []  # decided here, not yet written
        self._deletes: list[tuple[str, str]] = []  # (instance, request id) to HDEL
        self._foreign: set[str] = set()  # ids merged from other replicas
        self._dropped: dict[str, float] = {}  # tombstones: request id -> wall time dropped

    @property
    def ttl_s(self) -> float:
        return self.ledger.ttl_s

    def record(self, entry: LedgerEntry) -> None:
        """A decision of this replica (the decision path: memory only)."""
        self.ledger.add(entry)
        self._adds.append(entry)

    def has_writes(self) -> bool:
        return bool(self._adds or self._deletes)

    def take_writes(self) -> tuple[list[LedgerEntry], list[tuple[str, str]]]:
        """Entries to HSET and (instance, id) pairs to HDEL since the last call."""
        adds, self._adds = self._adds, []
        deletes, self._deletes = self._deletes, []
        return adds, deletes

    def _drop(self, instance_id: str, request_id: str, now_s: float) -> None:
        self._dropped[request_id] = now_s
        self._foreign.discard(request_id)
        self._deletes.append((instance_id, request_id))

    def done(self, request_id: str, instance_id: str, now_s: float) -> None:
        """RequestDoneEvent: drop it here and in Redis, and never re-add it.

        Every replica gets the event; only those that held the entry delete it in
        Redis (the deciding one always does, unless a snapshot reconciled it first).
        """
        if self.ledger.remove(request_id):
            self._drop(instance_id, request_id, now_s)
        else:
            self._dropped[request_id] = now_s

    def reconcile(self, instance_id: str, visible_ids: AbstractSet[str], now_s: float) -> int:
        """Drop the entries the instance's snapshot now shows (here and in Redis)."""
        seen = self.ledger.reconcile_ids(instance_id, visible_ids)
        for rid in seen:
            self._drop(instance_id, rid, now_s)
        return len(seen)

    def merge(
        self,
        instance_id: str,
        stored: Mapping[bytes, bytes],
        visible_ids: AbstractSet[str],
        now_s: float,
    ) -> int:
        """Fold the instance's Redis hash into the local ledger. Returns entries added.

        Only unknown ids are decoded. Another replica's entry that left Redis (it
        was reconciled or finished there) leaves here too; this replica's own
        entries may simply not be written yet, so they stay.
        """
        added = 0
        stored_ids: set[str] = set()
        for raw_id, data in stored.items():
            # 1. Known, dropped before or already in the snapshot: nothing to do.
            rid = raw_id.decode()
            stored_ids.add(rid)
            if rid in self.ledger or rid in self._dropped or rid in visible_ids:
                continue
            # 2. New: decode; an expired entry is deleted, not added.
            entry = LEDGER_ENTRY_DECODER.decode(data)
            if now_s - entry.dispatched_at_s > self.ttl_s or entry.instance_id != instance_id:
                self._drop(instance_id, rid, now_s)
                continue
            self.ledger.add(entry)
            self._foreign.add(rid)
            added += 1
        # 3. Another replica's entries gone from the hash.
        for entry in self.ledger.pending(instance_id):
            rid = entry.request_id
            if rid in self._foreign and rid not in stored_ids:
                self.ledger.remove(rid)
                self._foreign.discard(rid)
        return added

    def expire(self, now_s: float) -> int:
        """TTL: drop old entries (and Redis copies) and forget old tombstones."""
        old = self.ledger.expire_entries(now_s)
        for e in old:
            self._drop(e.instance_id, e.request_id, now_s)
        stale = [rid for rid, t in self._dropped.items() if now_s - t > self.ttl_s]
        for rid in stale:
            del self._dropped[rid]
        return len(old)

    def forget_instance(self, instance_id: str) -> None:
        for e in self.ledger.pending(instance_id):
            self._foreign.discard(e.request_id)
        self.ledger.forget_instance(instance_id)


def encode_entries(entries: Iterable[LedgerEntry]) -> list[tuple[str, str, bytes]]:
    """(instance, request id, msgpack entry) per entry, for `Store.write_ledger`."""
    return [(e.instance_id, e.request_id, LEDGER_ENTRY_ENCODER.encode(e)) for e in entries]
