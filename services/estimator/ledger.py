"""Requests this estimator dispatched that no snapshot shows yet.

Between a routing decision and the first snapshot that contains the request,
the chosen instance looks no busier than before; without the ledger a burst of
requests would all herd onto the instance that looked emptiest. An entry leaves
the ledger when a snapshot of its instance lists the request id, when the
request ends (RequestDoneEvent), or after `ttl_s` (a lost event must not
inflate an instance's load for ever).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    request_id: str
    instance_id: str
    num_prompt_tokens: int  # tokens
    max_tokens: int  # tokens
    dispatched_at_s: float  # time.monotonic() of the decision
    predicted_output_tokens: int | None = None  # tokens, the length the decision assumed


class Ledger:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._entries: dict[str, LedgerEntry] = {}
        self._by_instance: dict[str, dict[str, LedgerEntry]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

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

    def reconcile(self, instance_id: str, visible_ids: set[str]) -> int:
        """Drop entries of `instance_id` that its snapshot now shows. Returns how many."""
        pending = self._by_instance.get(instance_id)
        if not pending:
            return 0
        seen = [rid for rid in pending if rid in visible_ids]
        for rid in seen:
            self.remove(rid)
        return len(seen)

    def pending(self, instance_id: str) -> list[LedgerEntry]:
        """Dispatched to `instance_id`, not yet visible in its snapshot."""
        return list(self._by_instance.get(instance_id, {}).values())

    def expire(self, now_s: float) -> int:
        old = [
            e.request_id for e in self._entries.values() if now_s - e.dispatched_at_s > self.ttl_s
        ]
        for rid in old:
            self.remove(rid)
        return len(old)

    def forget_instance(self, instance_id: str) -> None:
        for rid in list(self._by_instance.pop(instance_id, {})):
            self._entries.pop(rid, None)
