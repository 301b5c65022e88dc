"""SFS replay: predicted TTFT and E2E of a new query on one instance, from its snapshot.

    TTFT_hat = sum over iterations l = 1 .. l_first of T_hat(batch_l)     (seconds)

where the batches are what the instance's own scheduler builds from the snapshot's
state, with the ledger's dispatched-but-unseen requests appended to the waiting
queue (dispatch order) and the new query (the *probe*) behind them, and l_first is
the iteration that samples the probe's first token. E2E_hat continues to the
iteration that samples its last (predicted) token. Times count from the snapshot,
not from now: the iterations the engine ran since the snapshot are replayed again,
so the estimate is high by up to the snapshot's age (now - snapshot.wall_time_s);
with per-iteration snapshots that is about one batch time.

Two implementations of the same replay:

* `exact_replay.replay_exact` restores a real `Scheduler` (`restore_scheduler`) and steps it:
  the engine's code itself; the reference, used by tests and for debugging;
* `estimate` / `SfsReplayer` run `kernel.KernelState`, the same policy on flat
  counters with a lazy decode group and bulk skips: on a 64-request snapshot ~80x
  cheaper to the first token and ~300x to the last; checked against `replay_exact`
  batch for batch in tests, on snapshots without token-routing guests (the kernel
  admits waiting guests in queue order and does not model the chunk cap beside
  them). Its mypyc build runs when one exists (`native`).

Request lengths in the replay (`output_policy.OutputPolicy`): a request finishes when its output
reaches min(predicted_output_tokens, max_tokens); requests without a prediction use
`default_output_tokens`; a request already past its prediction is given
`min_remaining_tokens` more. The snapshot's pending requests (a peer is
writing) keep their KV and are never scheduled in the replay.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from services.estimator.sfs.kernel import KernelState, RunResult
from services.estimator.sfs.native import IMPL as kernel_impl  # this module or its build
from services.estimator.sfs.output_policy import OutputPolicy
from shared.scheduling.batch_time import BatchTimeModel
from shared.scheduling.snapshot import WorkloadSnapshot

PROBE_ID = "__sfs_probe__"
# iterations a replay steps to catch up with a snapshot's age (`run_in_flight`)
MAX_CATCH_UP_STEPS = 256


@dataclass(frozen=True, slots=True)
class Probe:
    """The query being routed."""

    num_prompt_tokens: int  # tokens
    predicted_output_tokens: int  # tokens (the E2E horizon)
    max_tokens: int  # tokens, the request's cap


class PendingLike(Protocol):
    """A ledger entry: dispatched to the instance, not yet in its snapshot.

    `services.estimator.ledger.LedgerEntry` fits; a `predicted_output_tokens`
    attribute is used when present.
    """

    @property
    def request_id(self) -> str: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class PendingRequest:
    """A ledger entry with its predicted length (satisfies PendingLike)."""

    request_id: str
    num_prompt_tokens: int  # tokens
    max_tokens: int  # tokens
    predicted_output_tokens: int | None = None  # tokens


@dataclass(frozen=True, slots=True)
class ReplayEstimate:
    """Modeled latency of the probe on one instance, seconds from the snapshot."""

    ttft_s: float  # inf when the probe would never start (does not fit, stall)
    e2e_s: float | None  # None unless asked
    num_steps_ttft: int  # iterations up to the probe's first token
    num_steps: int  # iterations replayed in all
    num_pending: int  # ledger entries simulated
    num_pending_visible: int  # ledger entries skipped: the snapshot already shows them


def snapshot_ids(snapshot: WorkloadSnapshot) -> frozenset[str]:
    """Ids of every request the snapshot shows (running, waiting, pending)."""
    return frozenset(snapshot.request_ids)


def kernel_state(
    snapshot: WorkloadSnapshot, policy: OutputPolicy, *, group: bool = True
) -> KernelState:
    """The snapshot's scheduler state as kernel counters (no ledger, no probe).

    `group` forms the lazy decode group at once (see `kernel`); False keeps every
    request stepped one by one (the tests' plain mirror of `Scheduler`). The
    snapshot's columns go to `kernel.build_state` as they are (same row order, -1 for
    no prediction; it copies what it keeps and reads no waiting row's blocks),
    compiled with the kernel where its build loads.
    """
    policy = policy.for_snapshot(snapshot)
    st: KernelState = kernel_impl.build_state(
        (
            snapshot.scheduler.max_num_seqs,
            snapshot.scheduler.max_num_batched_tokens,
            snapshot.scheduler.block_size,
            snapshot.scheduler.num_kv_blocks,
        ),
        snapshot.num_running,
        snapshot.num_pending,
        snapshot.request_ids,
        snapshot.prompt_tokens,
        snapshot.output_tokens,
        snapshot.computed_tokens,
        snapshot.max_tokens,
        snapshot.predicted_output_tokens,
        snapshot.num_blocks,
        policy.default_output_tokens,
        policy.min_remaining_tokens,
        list(policy.length_ratios),
        list(policy.capped_length_ratios),
        group,
    )
    return st


Entry = tuple[str, int, int, int | None]  # (request id, prompt, max_tokens, predicted)


def admissible_pending(
    pending: Iterable[PendingLike],
    snapshot: WorkloadSnapshot,
    visible: frozenset[str] | None = None,
) -> tuple[list[Entry], int]:
    """Ledger entries to simulate, in dispatch order, as (id, prompt, max_tokens, predicted).

    Skips ids the snapshot already shows (never counted twice), repeated ids, and
    entries that cannot fit the context; max_tokens is capped by the context limit as
    the engine does. `visible` is snapshot_ids(snapshot) when the caller has it.
    Returns (entries, number skipped because visible).
    """
    max_model_len = snapshot.scheduler.max_model_len
    seen: set[str] = set()
    entries: list[Entry] = []
    num_visible = 0
    for e in pending:
        if visible is None:  # built only when there is a ledger entry
            visible = snapshot_ids(snapshot)
        rid = e.request_id
        if rid in visible:
            num_visible += 1
            continue
        if rid in seen:
            continue
        seen.add(rid)
        max_tokens = min(e.max_tokens, max_model_len - e.num_prompt_tokens)
        if e.num_prompt_tokens < 1 or max_tokens < 1:
            continue
        predicted = getattr(e, "predicted_output_tokens", None)
        entries.append((rid, e.num_prompt_tokens, max_tokens, predicted))
    return entries, num_visible


def probe_max_tokens(probe: Probe, max_model_len: int) -> int:
    """The probe's cap after the context limit; < 1 means it cannot run here."""
    return min(probe.max_tokens, max_model_len - probe.num_prompt_tokens)


def queue_entry(st: KernelState, entry: Entry, policy: OutputPolicy) -> None:
    """A dispatched request joins the end of the waiting queue of `st`."""
    rid, prompt, max_tokens, predicted = entry
    target = policy.target(predicted, max_tokens, 0, rid)
    st.waiting.append(st.add(rid, prompt, 0, 0, 0, target))


def in_dispatch_order(
    entries: Sequence[Entry], offset_s: Mapping[str, float]
) -> list[tuple[float, Entry]]:
    """`run_in_flight`'s `unseen`: (dispatch time - snapshot time, entry) per entry,
    earliest first (equal times keep their order)."""
    return sorted(((offset_s[e[0]], e) for e in entries), key=lambda u: u[0])


def run_in_flight(
    st: KernelState,
    coefs: tuple[float, ...],
    age_s: float,
    max_steps: int,
    policy: OutputPolicy,
    unseen: Sequence[tuple[float, Entry]] = (),
) -> tuple[float, list[Entry]]:
    """Step `st` (mutated) through the iterations the engine has run since its
    snapshot, up to the one in flight `age_s` after it. Returns when that one ends,
    seconds from the snapshot (0: idle at the snapshot; <= age_s: idle by now, so a
    query arriving now starts at once), and the entries of `unseen` that have not
    joined an iteration yet (dispatched while the one in flight ran: they queue
    ahead of the query).

    An engine steps back to back while it has work and takes new requests only
    between iterations, so a query that arrives `age_s` after the snapshot joins the
    first iteration that starts at or after it (the first, which began at the
    snapshot's time, is in flight whatever the age). A snapshot can be older than one
    iteration (the estimator reads them every `snapshot_refresh_s`; a short step
    takes less): then the engine has finished some, and the query waits for what is
    left of the one running now, not of the first.

    `unseen`: (dispatch time - snapshot time, entry) of the requests the snapshot does
    not show, in dispatch order; each joins the first iteration that starts at or
    after its dispatch (a negative time: the first), and an idle engine starts at the
    next dispatch. At most `MAX_CATCH_UP_STEPS` are stepped: a snapshot that much
    older than its iterations says little about now, and the decision must stay cheap
    (past the cap the replay goes on from there as if it were now).
    """
    elapsed = 0.0
    i, n = 0, len(unseen)
    for _ in range(min(max_steps, MAX_CATCH_UP_STEPS)):
        # 1. Requests dispatched by the time this iteration starts are in its queue.
        while i < n and unseen[i][0] <= elapsed:
            queue_entry(st, unseen[i][1], policy)
            i += 1
        t = st.step(coefs, None)
        if t < 0.0:
            # 2. Nothing to run: idle until the next dispatch before now, if any.
            if i < n and unseen[i][0] < age_s:
                elapsed = max(elapsed, unseen[i][0])
                continue
            break
        elapsed += t
        if elapsed >= age_s:  # 3. the iteration in flight now (a query at its end joins the next)
            break
    return elapsed, [e for _, e in unseen[i:]]


def run_on_state(
    st: KernelState,
    entries: Sequence[Entry],
    probe: Probe,
    coefs: tuple[float, ...],
    policy: OutputPolicy,
    *,
    max_model_len: int,
    max_steps: int,
    want_e2e: bool = False,  # also run on to the probe's last token
    fast: bool = True,
    trace: list[list[tuple[str, int]]] | None = None,
) -> RunResult:
    """Append ledger entries and the probe to `st` (mutated) and replay."""
    for entry in entries:
        queue_entry(st, entry, policy)
    cap = probe_max_tokens(probe, max_model_len)
    if probe.num_prompt_tokens < 1 or cap < 1:
        return RunResult(math.inf, math.inf if want_e2e else math.nan, 0, 0)
    target = min(max(probe.predicted_output_tokens, 1), cap)
    slot = st.add(PROBE_ID, probe.num_prompt_tokens, 0, 0, 0, target)
    st.waiting.append(slot)
    return st.run(coefs, slot, want_e2e=want_e2e, max_steps=max_steps, fast=fast, trace=trace)


def to_estimate(r: RunResult, want_e2e: bool, num_pending: int, num_visible: int) -> ReplayEstimate:
    return ReplayEstimate(
        ttft_s=r.ttft_s,
        e2e_s=r.e2e_s if want_e2e else None,
        num_steps_ttft=r.num_steps_ttft,
        num_steps=r.num_steps,
        num_pending=num_pending,
        num_pending_visible=num_visible,
    )


def estimate(
    snapshot: WorkloadSnapshot,
    model: BatchTimeModel,
    probe: Probe,
    pending: Iterable[PendingLike] = (),
    *,
    want_e2e: bool = False,
    policy: OutputPolicy = OutputPolicy(),
    max_steps: int = 1_000_000,
) -> ReplayEstimate:
    """SFS estimate on one snapshot, no caching (see `SfsReplayer` for the cached one)."""
    st = kernel_state(snapshot, policy)
    entries, num_visible = admissible_pending(pending, snapshot)
    r = run_on_state(
        st,
        entries,
        probe,
        model.raw,
        policy.for_snapshot(snapshot),
        max_model_len=snapshot.scheduler.max_model_len,
        want_e2e=want_e2e,
        max_steps=max_steps,
    )
    return to_estimate(r, want_e2e, len(entries), num_visible)


class SfsReplayer:
    """Per-estimator replayer: caches each instance's parsed snapshot by version.

    A decision costs one list copy of the cached state plus the replay to the probe's
    first token; the snapshot is parsed once per (instance, version, wall time).
    """

    def __init__(self, policy: OutputPolicy | None = None, *, max_steps: int = 200_000) -> None:
        self.policy = policy or OutputPolicy()
        self.max_steps = max_steps
        # instance -> ((version, wall time), parsed state, [ids the snapshot shows], the
        # policy with the snapshot's length ratios)
        self._cache: dict[
            str, tuple[tuple[int, float], KernelState, list[frozenset[str]], OutputPolicy]
        ] = {}

    def forget(self, instance_id: str) -> None:
        self._cache.pop(instance_id, None)

    def prepare(self, instance_id: str, snapshot: WorkloadSnapshot) -> None:
        """Parse a snapshot ahead of decisions (call it where snapshots are read: the
        ~60 us parse of a 64-request snapshot then stays off the decision path)."""
        self._base(instance_id, snapshot)

    def _base(
        self, instance_id: str, snapshot: WorkloadSnapshot
    ) -> tuple[KernelState, list[frozenset[str]], OutputPolicy]:
        key = (snapshot.version, snapshot.wall_time_s)
        hit = self._cache.get(instance_id)
        if hit is None or hit[0] != key:
            policy = self.policy.for_snapshot(snapshot)
            hit = (key, kernel_state(snapshot, policy), [], policy)
            self._cache[instance_id] = hit
        return hit[1], hit[2], hit[3]

    def estimate(
        self,
        instance_id: str,
        snapshot: WorkloadSnapshot,
        probe: Probe,
        pending: Iterable[PendingLike] = (),
        *,
        model: BatchTimeModel | None = None,
        want_e2e: bool = False,
    ) -> ReplayEstimate:
        """TTFT (and E2E) of `probe` on `instance_id`, priced with `model` or, when None,
        with the calibration the snapshot carries (ValueError if it carries none)."""
        model = model or BatchTimeModel.from_snapshot(snapshot)
        if model is None:
            raise ValueError(f"no batch-time model for {instance_id}")
        base, ids, policy = self._base(instance_id, snapshot)
        pending = list(pending)
        if pending and not ids:
            ids.append(snapshot_ids(snapshot))  # once per snapshot, lazily
        entries, num_visible = admissible_pending(pending, snapshot, ids[0] if ids else None)
        r = run_on_state(
            base.copy(),
            entries,
            probe,
            model.raw,
            policy,
            max_model_len=snapshot.scheduler.max_model_len,
            want_e2e=want_e2e,
            max_steps=self.max_steps,
        )
        return to_estimate(r, want_e2e, len(entries), num_visible)
