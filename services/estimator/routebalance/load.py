"""An instance's load as a RouteBalance batch sees it: read once per batch from its
snapshot and the ledger's dispatches the snapshot does not show yet, then dead-reckoned
after every assignment of the batch.

Reconciling with the ledger (by request id, as the estimator's ledger does) keeps the
dispatches of the previous batches that the snapshot has not shown yet, so consecutive
batches do not herd onto an instance whose snapshot still looks idle.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.estimator.ledger import LedgerEntry
from services.estimator.sfs.output_policy import OutputPolicy
from shared.scheduling.snapshot import WorkloadSnapshot


@dataclass(slots=True)
class InstanceLoad:
    """Counts of one instance; `add` is the dead-reckoning step."""

    instance_id: str
    model: str
    max_num_seqs: int
    num_running: int = 0
    num_waiting: int = 0
    pending_decode_tokens: int = 0  # output tokens its requests are still expected to write
    last_assigned: int = -1  # order of the latest assignment here (-1: none yet)

    @property
    def num_requests(self) -> int:
        return self.num_running + self.num_waiting

    @property
    def has_free_slot(self) -> bool:
        """Whether one more request runs in its next step (a decode slot is free)."""
        return self.num_requests < self.max_num_seqs

    @property
    def decode_batch(self) -> int:
        """Requests a decode step of this instance writes for (at least 1)."""
        return max(1, min(self.num_requests, self.max_num_seqs))

    def add(self, output_tokens: int, order: int) -> None:
        """Count a request just assigned here (waiting, and its decode to come)."""
        self.num_waiting += 1
        self.pending_decode_tokens += output_tokens
        self.last_assigned = order


def load_of(
    instance_id: str,
    model: str,
    max_num_seqs: int,
    snapshot: WorkloadSnapshot | None,
    unseen: list[LedgerEntry],
    lengths: OutputPolicy,
) -> InstanceLoad:
    """The instance's load from its snapshot (None: stale or missing, only the ledger is
    known) plus the dispatches the snapshot does not show yet (`unseen`). A request's
    decode still to come is where `lengths` ends it (the SFS replay's rule: its
    prediction, else the default, capped at max_tokens; the snapshot's measured length
    ratios when it carries them) less what it wrote."""
    load = InstanceLoad(instance_id, model, max_num_seqs)
    if snapshot is not None:
        lengths = lengths.for_snapshot(snapshot)
        load.num_running = snapshot.num_running
        load.num_waiting = len(snapshot.request_ids) - snapshot.num_running
        for i in range(len(snapshot.request_ids)):
            predicted = snapshot.predicted_output_tokens[i]
            written = snapshot.output_tokens[i]
            rid = snapshot.request_ids[i]
            end = lengths.target(
                None if predicted < 0 else predicted, snapshot.max_tokens[i], written, rid
            )
            load.pending_decode_tokens += end - written
    for entry in unseen:
        load.num_waiting += 1
        load.pending_decode_tokens += lengths.target(
            entry.predicted_output_tokens, entry.max_tokens, 0, entry.request_id
        )
    return load
