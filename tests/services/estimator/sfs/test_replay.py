"""The SFS replay equals the engine scheduler's own schedule; TTFT is the sum of
modeled batch times; the ledger is simulated as waiting and never double-counted."""

from __future__ import annotations

import math
import random

import pytest

from services.estimator.sfs.exact_replay import replay_exact
from services.estimator.sfs.output_policy import OutputPolicy
from services.estimator.sfs.replay import (
    PROBE_ID,
    PendingRequest,
    Probe,
    SfsReplayer,
    admissible_pending,
    estimate,
    kernel_state,
    run_on_state,
)
from shared.scheduling.batch_time import (
    EIGHT_TERM,
    FOUR_TERM,
    SEVEN_TERM,
    SIX_TERM,
    BatchTimeModel,
)
from shared.scheduling.snapshot import WorkloadSnapshot, take_snapshot
from tests.services.estimator.sfs.builders import (
    MODEL,
    as_pairs,
    make_scheduler,
    random_live,
    random_pending,
    step,
)

RUN_TO_MAX = OutputPolicy(default_output_tokens=10**6)  # no prediction: run to max_tokens


def kernel_batches(
    snap: WorkloadSnapshot,
    model: BatchTimeModel,
    probe: Probe,
    ledger: list[PendingRequest],
    policy: OutputPolicy,
    group: bool = True,
) -> list[list[tuple[str, int]]]:
    """The batches the kernel runs (run_on_state's trace) up to the probe's end."""
    trace: list[list[tuple[str, int]]] = []
    entries, _ = admissible_pending(ledger, snap)
    run_on_state(
        kernel_state(snap, policy, group=group),
        entries,
        probe,
        model.raw,
        policy,
        max_model_len=snap.scheduler.max_model_len,
        want_e2e=True,
        max_steps=10**6,
        trace=trace,
    )
    return trace


@pytest.mark.parametrize("seed", range(40))
def test_replay_equals_live_scheduler(seed: int, kernel_impl: str) -> None:
    """Snapshot a live scheduler, then let the live one go on with the same ledger
    arrivals and the probe: the replay's batches are the live batches, in order."""
    rng = random.Random(seed)
    live = random_live(rng, predicted=True)
    snap = take_snapshot(live, 7, 0.0)
    ledger = random_pending(rng, "L", 3, prompt=50, max_tokens=60, predicted=30)
    probe = Probe(rng.randint(1, 60), rng.randint(1, 20), 64)

    for e in ledger:  # the live engine receives them in dispatch order, then the probe
        cap = min(e.max_tokens, live.config.max_model_len - e.num_prompt_tokens)
        req = live.add(e.request_id, e.num_prompt_tokens, cap)
        req.predicted_output_tokens = e.predicted_output_tokens
    cap = min(probe.max_tokens, live.config.max_model_len - probe.num_prompt_tokens)
    live_probe = live.add(PROBE_ID, probe.num_prompt_tokens, cap)
    live_probe.predicted_output_tokens = probe.predicted_output_tokens
    live_batches = []
    while not live_probe.is_finished:
        live_batches.append(as_pairs(step(live)))

    exact = replay_exact(snap, MODEL, probe, ledger, want_e2e=True, policy=RUN_TO_MAX)
    assert exact.batches == live_batches
    assert exact.estimate.e2e_s == pytest.approx(sum(exact.batch_times_s))

    assert kernel_batches(snap, MODEL, probe, ledger, RUN_TO_MAX) == live_batches


MODEL_PER_SET = {
    SIX_TERM: MODEL,
    FOUR_TERM: BatchTimeModel(FOUR_TERM, (1e-2, 3e-4, 2e-6, 1e-6)),
    # The decode group's closed form must price D^2 over its bulk-skipped steps too.
    SEVEN_TERM: BatchTimeModel(SEVEN_TERM, (*MODEL.coefs, 4e-5)),
    # ... and HP only on the steps that prefill (none of the bulk-skipped ones).
    EIGHT_TERM: BatchTimeModel(EIGHT_TERM, (*MODEL.coefs, 4e-5, 3e-3)),
}


@pytest.mark.parametrize("feature_set", [SIX_TERM, FOUR_TERM, SEVEN_TERM, EIGHT_TERM])
def test_fast_kernel_equals_scheduler_on_random_workloads(
    feature_set: str, kernel_impl: str
) -> None:
    """The flat-counter kernel (decode group, bulk skips) against the real Scheduler:
    same batches, same TTFT and E2E, same step counts, preemptions and requests parked
    for a peer (never scheduled, KV held) included."""
    model = MODEL_PER_SET[feature_set]
    rng = random.Random(11)
    num_preempted = 0
    for trial in range(150):
        # half the trials end requests at expected lengths given measured ratios
        ratios = (0.6, 0.9, 1.3, 2.0) if trial % 4 < 2 else ()
        policy = OutputPolicy(default_output_tokens=25, length_ratios=ratios)
        live = random_live(rng, predicted=trial % 2 == 0, peer=trial % 5 == 0)
        num_preempted += sum(r.num_preemptions for r in live.requests.values())
        snap = take_snapshot(live, trial, 0.0)
        ledger = [PendingRequest(f"L{k}", rng.randint(1, 50), rng.randint(1, 60)) for k in range(2)]
        probe = Probe(rng.randint(1, 70), rng.randint(1, 30), 50)
        exact = replay_exact(snap, model, probe, ledger, want_e2e=True, policy=policy)

        trace = kernel_batches(snap, model, probe, ledger, policy, group=trial % 3 != 0)
        assert trace == exact.batches, trial

        fast = estimate(snap, model, probe, ledger, want_e2e=True, policy=policy)
        want = exact.estimate
        assert fast.ttft_s == pytest.approx(want.ttft_s, rel=1e-9)
        assert fast.e2e_s == pytest.approx(want.e2e_s, rel=1e-9)
        assert (fast.num_steps_ttft, fast.num_steps) == (want.num_steps_ttft, want.num_steps)
    assert num_preempted > 0  # the workloads did exercise preemption


def test_ttft_is_the_sum_of_modeled_batch_times() -> None:
    """Budget 4, one decoding request "a"; the probe's 10-token prompt is chunked 3+3+3+1
    behind a's decodes, its first token comes with the 4th batch."""
    live = make_scheduler(max_num_batched_tokens=4)
    live.add("a", 3, 10)
    step(live)  # a: prefill 3 tokens, samples its first token
    snap = take_snapshot(live, 1, 0.0)
    model = BatchTimeModel(SIX_TERM, (1.0, 0.1, 0.01, 0.5, 0.001, 0.0))
    # step: b0 + 0.1 P + 0.01 sum p^2 + 0.5 D + 0.001 S   (S = contexts after the step)
    by_hand = [
        1 + 0.3 + 0.09 + 0.5 + 0.001 * (4 + 3),
        1 + 0.3 + 0.09 + 0.5 + 0.001 * (5 + 6),
        1 + 0.3 + 0.09 + 0.5 + 0.001 * (6 + 9),
        1 + 0.1 + 0.01 + 0.5 + 0.001 * (7 + 10),
    ]
    then = [1 + 0.5 * 2 + 0.001 * (8 + 11), 1 + 0.5 * 2 + 0.001 * (9 + 12)]  # both decode
    probe = Probe(10, 3, 100)
    for est in (
        estimate(snap, model, probe, want_e2e=True, policy=RUN_TO_MAX),
        replay_exact(snap, model, probe, want_e2e=True, policy=RUN_TO_MAX).estimate,
    ):
        assert est.ttft_s == pytest.approx(sum(by_hand))
        assert est.num_steps_ttft == 4
        assert est.e2e_s == pytest.approx(sum(by_hand) + sum(then))
        assert est.num_steps == 6
    exact = replay_exact(snap, model, probe, policy=RUN_TO_MAX)
    assert exact.batches == [[("a", 1), (PROBE_ID, 3)]] * 3 + [[("a", 1), (PROBE_ID, 1)]]


def test_empty_instance_ttft_is_one_prefill() -> None:
    snap = take_snapshot(make_scheduler(max_num_batched_tokens=64), 1, 0.0)
    model = BatchTimeModel(SIX_TERM, (0.002, 1e-5, 0.0, 0.0, 0.0, 0.0))
    est = estimate(snap, model, Probe(50, 5, 10))
    assert est.ttft_s == pytest.approx(0.002 + 50e-5)
    assert est.e2e_s is None


def test_ledger_entries_wait_ahead_of_the_probe_in_dispatch_order() -> None:
    live = make_scheduler(max_num_batched_tokens=16)
    live.add("a", 4, 50)
    step(live)
    snap = take_snapshot(live, 1, 0.0)
    ledger = [PendingRequest("L1", 20, 5), PendingRequest("L2", 8, 5)]
    exact = replay_exact(snap, MODEL, Probe(6, 1, 5), ledger)
    order = [rid for batch in exact.batches for rid, _ in batch if rid != "a"]
    assert order.index("L1") < order.index("L2") < order.index(PROBE_ID)
    alone = estimate(snap, MODEL, Probe(6, 1, 5))
    behind = estimate(snap, MODEL, Probe(6, 1, 5), ledger)
    assert behind.num_pending == 2
    assert behind.ttft_s == pytest.approx(exact.estimate.ttft_s)
    assert behind.ttft_s > alone.ttft_s


def test_ledger_ids_the_snapshot_shows_are_not_counted_twice() -> None:
    live = make_scheduler(max_num_seqs=1)
    live.add("a", 10, 20)
    live.add("b", 10, 20)  # waiting: the running cap is 1
    step(live)
    snap = take_snapshot(live, 1, 0.0)
    assert {c.request_id for c in snap.waiting} == {"b"}
    probe = Probe(5, 2, 5)
    base = estimate(snap, MODEL, probe)
    seen = [PendingRequest("a", 10, 20), PendingRequest("b", 10, 20)]
    est = estimate(snap, MODEL, probe, seen)
    assert (est.num_pending, est.num_pending_visible) == (0, 2)
    assert est.ttft_s == base.ttft_s
    dup = [PendingRequest("L", 10, 5), PendingRequest("L", 10, 5)]
    once = estimate(snap, MODEL, probe, dup[:1])
    twice = estimate(snap, MODEL, probe, dup)
    assert twice.num_pending == 1 and twice.ttft_s == once.ttft_s


def test_replayer_caches_per_version_without_leaking_state() -> None:
    rng = random.Random(3)
    live = random_live(rng, predicted=True)
    snap = take_snapshot(live, 5, 1.0)
    rep = SfsReplayer(RUN_TO_MAX)
    probe = Probe(30, 10, 40)
    first = rep.estimate("i0", snap, probe, model=MODEL, want_e2e=True)
    second = rep.estimate("i0", snap, probe, model=MODEL, want_e2e=True)
    plain = estimate(snap, MODEL, probe, want_e2e=True, policy=RUN_TO_MAX)
    assert first == second == plain
    # The calibration the snapshot carries is used when no model is given.
    import msgspec

    priced = msgspec.structs.replace(
        snap, version=6, batch_time_features=MODEL.feature_set, batch_time_coefs=list(MODEL.coefs)
    )
    assert rep.estimate("i0", priced, probe).ttft_s == pytest.approx(plain.ttft_s)
    with pytest.raises(ValueError):
        rep.estimate("i1", snap, probe)


def test_probe_longer_than_the_context_never_starts() -> None:
    snap = take_snapshot(make_scheduler(max_model_len=64), 1, 0.0)
    est = estimate(snap, MODEL, Probe(64, 5, 5))
    assert math.isinf(est.ttft_s)
