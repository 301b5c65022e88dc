"""The pieces behind scripts/bench_sfs.py on tiny cases: metrics, the in-flight-aware
SFS estimate (against the engine's own Scheduler), the single-instance and the routed
discrete-event simulations. Deterministic; no timing."""

from __future__ import annotations

import math
import random

import pytest

from bench.cluster_sim import (
    Arrival,
    ClusterSimSettings,
    SimRequest,
    WorkloadSimEngine,
    make_requests,
    simulate_cluster,
    simulate_single,
)
from bench.sfs_evaluation import (
    auc_ratio,
    estimate_from_now,
    ks_distance,
    mape,
    signed_relative_errors,
    trapezoid_area,
)
from bench.stats import percentile
from services.estimator.policies import create_policy
from services.estimator.sfs.output_policy import OutputPolicy
from services.estimator.sfs.replay import MAX_CATCH_UP_STEPS, PendingRequest, Probe
from services.estimator.sfs.utility import default_ttft_target_s
from services.worker.engine.sim import SimEngine, SimEngineConfig
from shared.config import parse_cluster
from shared.sampling import SamplingParams
from shared.scheduling.snapshot import restore_scheduler, take_snapshot
from tests.services.estimator.sfs.builders import (
    LONG,
    MODEL,
    SIM_CFG,
    SIM_MODEL,
    make_scheduler,
    query_ttft,
    random_live,
    run_until,
    step,
    three_decodes_s,
    three_decoding,
)
from tests.support.clusters import instance, preset, table

# ---- metrics --------------------------------------------------------------------------


def test_mape_and_signed_errors() -> None:
    assert mape([1.1, 0.5], [1.0, 1.0]) == pytest.approx(0.3)
    assert mape([5.0, 2.0], [0.0, 1.0]) == pytest.approx(1.0)  # actual 0 is skipped
    assert math.isnan(mape([1.0], [0.0]))
    assert signed_relative_errors([1.5, 0.5], [1.0, 1.0]) == [0.5, -0.5]
    with pytest.raises(ValueError):
        mape([1.0], [1.0, 2.0])


def test_percentile_interpolates() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile([1.0, math.inf], 100) == math.inf
    assert math.isnan(percentile([], 50))


def test_ks_distance() -> None:
    assert ks_distance([1.0, 2.0, 3.0], [3.0, 1.0, 2.0]) == 0.0
    assert ks_distance([1.0, 2.0], [5.0, 6.0]) == 1.0
    # F_a jumps to 1/2 at 1; F_b is 0 until 2: sup |F_a - F_b| = 1/2
    assert ks_distance([1.0, 3.0], [2.0, 3.0]) == pytest.approx(0.5)


def test_trapezoid_and_auc_ratio() -> None:
    assert trapezoid_area([0.0, 1.0, 3.0], [1.0, 1.0, 0.0]) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        trapezoid_area([0.0, 0.0], [1.0, 1.0])
    curves = {
        "sfs": {1.0: 1.0, 2.0: 1.0, 3.0: 1.0},  # area 2
        "a": {1.0: 1.0, 2.0: 0.5, 3.0: 0.0},  # area 1
        "b": {1.0: 0.8, 2.0: 0.8, 3.0: 0.8, 4.0: 9.0},  # area 1.6 on the shared rates
    }
    ratio, best = auc_ratio(curves, "sfs", ["a", "b"])
    assert best == "b"
    assert ratio == pytest.approx(2.0 / 1.6)
    with pytest.raises(ValueError):
        auc_ratio({"sfs": {1.0: 1.0}, "a": {1.0: 1.0}}, "sfs", ["a"])


# ---- in-flight-aware SFS estimate --------------------------------------------------------


def _reference_from_now(live, model, probe, joined, pending, age):  # type: ignore[no-untyped-def]
    """The same thing on the engine's own Scheduler: steps as the snapshot left it (with
    `joined`) until the one running at `age` (at most MAX_CATCH_UP_STEPS), then the
    ledger and the probe queued, stepped to the first token."""
    sched = restore_scheduler(take_snapshot(live, 1, 0.0))
    for e in joined:
        sched.add(e.request_id, e.num_prompt_tokens, e.max_tokens, e.predicted_output_tokens)
    in_flight = 0.0
    for _ in range(MAX_CATCH_UP_STEPS):
        batch = step(sched)
        if not len(batch):
            break
        in_flight += model.predict(batch)
        if in_flight >= age:
            break
    for e in pending:
        sched.add(e.request_id, e.num_prompt_tokens, e.max_tokens, e.predicted_output_tokens)
    req = sched.add(
        "probe", probe.num_prompt_tokens, probe.max_tokens, probe.predicted_output_tokens
    )
    clock = 0.0
    while req.num_output_tokens < 1:
        batch = step(sched)
        assert len(batch), "the reference stalled"
        clock += model.predict(batch)
    return max(0.0, in_flight - age) + clock


@pytest.mark.parametrize("seed", range(25))
def test_from_now_matches_scheduler_reference(seed: int) -> None:
    rng = random.Random(seed)
    live = random_live(rng, predicted=True)
    snap = take_snapshot(live, 1, 0.0)
    joined = [
        PendingRequest(f"J{k}", rng.randint(1, 30), rng.randint(1, 20), rng.randint(1, 20))
        for k in range(rng.randint(0, 2))
    ]
    pending = [
        PendingRequest(f"P{k}", rng.randint(1, 30), rng.randint(1, 20), rng.randint(1, 20))
        for k in range(rng.randint(0, 2))
    ]
    probe = Probe(rng.randint(1, 40), rng.randint(1, 20), 40)
    age = rng.choice([0.0, 0.004, 1.0])
    # The replay finishes requests at min(prediction, max_tokens), as `step` does.
    policy = OutputPolicy(default_output_tokens=10**6)
    got = estimate_from_now(snap, MODEL, probe, pending, age, joined=joined, policy=policy)
    want = _reference_from_now(live, MODEL, probe, joined, pending, age)
    assert got.ttft_s == pytest.approx(want, rel=1e-9)
    assert got.age_s == age


def test_from_now_on_an_idle_engine_is_the_probe_alone() -> None:
    s = make_scheduler()
    snap = take_snapshot(s, 1, 0.0)
    got = estimate_from_now(snap, MODEL, Probe(10, 5, 20), [], 0.5)
    assert got.in_flight_s == 0.0
    # one batch: the probe's 10-token prefill, context 10 after the step
    assert got.ttft_s == pytest.approx(MODEL.predict_raw([1, 10, 100, 0, 10, 100, 0, 55, 0, 1]))


def test_from_now_counts_only_what_is_left_of_the_step_in_flight() -> None:
    s = make_scheduler()
    s.add("a", 20, 10, 10)
    snap = take_snapshot(s, 1, 0.0)
    fresh = estimate_from_now(snap, MODEL, Probe(5, 5, 20), [], 0.0)
    later = estimate_from_now(snap, MODEL, Probe(5, 5, 20), [], 0.005)
    assert fresh.in_flight_s > 0.005
    assert later.ttft_s == pytest.approx(fresh.ttft_s - 0.005)
    # long after the snapshot "a" has finished: the probe runs alone on an idle engine
    gone = estimate_from_now(snap, MODEL, Probe(5, 5, 20), [], 10.0)
    idle = estimate_from_now(
        take_snapshot(make_scheduler(), 1, 0.0), MODEL, Probe(5, 5, 20), [], 0.0
    )
    assert gone.in_flight_s < 10.0
    assert gone.ttft_s == pytest.approx(idle.ttft_s)


@pytest.mark.parametrize("unseen_at", [None, 0.5, 1.2])
@pytest.mark.parametrize("steps_since", [0.3, 1.5, 2.5, 4.2])
def test_from_now_with_a_snapshot_older_than_one_iteration(
    steps_since: float, unseen_at: float | None
) -> None:
    """A SimEngine on a virtual clock runs on after its snapshot; a query arrives
    `steps_since` decode iterations later and joins the next one to start, and another
    request the snapshot does not show arrives `unseen_at` iterations after it (when
    that is before the query). The estimate from the old snapshot equals the TTFT the
    engine gives the query (the batch time is the model's, so nothing but the replay's
    schedule can differ)."""
    engine = SimEngine(SIM_CFG, SIM_MODEL)
    snap, t_snap = three_decoding(engine)
    decode_s = three_decodes_s(SIM_MODEL)
    arrival = t_snap + steps_since * decode_s
    unseen: list[PendingRequest] = []
    offsets: list[float] = []
    if unseen_at is not None and unseen_at < steps_since:
        joins = t_snap + unseen_at * decode_s
        run_until(engine, joins)
        engine.add_request("u", [1] * 30, LONG)
        unseen.append(PendingRequest("u", 30, 40))
        offsets.append(joins - t_snap)
    measured = query_ttft(engine, arrival)
    policy = OutputPolicy(default_output_tokens=10**6)
    got = estimate_from_now(
        snap,
        SIM_MODEL,
        Probe(12, 5, 5),
        unseen,
        arrival - t_snap,
        pending_offsets_s=offsets,
        policy=policy,
    )
    assert got.ttft_s == pytest.approx(measured, rel=1e-9)


# ---- single-instance simulation -------------------------------------------------------


def test_simulate_single_one_request() -> None:
    run = simulate_single(SIM_CFG, SIM_MODEL, [Arrival("a", 2.0, 30, 3)])
    assert run.ttft_s["a"] == pytest.approx(0.01 + 30e-3)  # one prefill batch
    # then 2 decode steps of 0.01 + 2e-3
    assert run.end_s == pytest.approx(2.0 + 0.04 + 2 * 0.012)
    assert run.busy_s == pytest.approx(0.04 + 2 * 0.012)
    assert run.num_steps == 3


def test_simulate_single_arrival_during_a_step_joins_the_next() -> None:
    # a's prefill runs [0, 0.07]; b arrives at 0.01 and joins at 0.07 with a's first decode
    run = simulate_single(SIM_CFG, SIM_MODEL, [Arrival("a", 0.0, 60, 5), Arrival("b", 0.01, 10, 2)])
    assert run.ttft_s["a"] == pytest.approx(0.07)
    assert run.ttft_s["b"] == pytest.approx(0.07 + (0.01 + 10e-3 + 2e-3) - 0.01)
    with pytest.raises(ValueError):
        simulate_single(SimEngineConfig(clock="wall"), SIM_MODEL, [])


def test_workload_engine_runs_to_the_true_length_not_the_prediction() -> None:
    engine = WorkloadSimEngine(SIM_CFG, SIM_MODEL)
    engine.expect("a", 7)
    engine.add_request("a", [100] * 5, SamplingParams(max_tokens=50), predicted_output_tokens=3)
    assert engine.snapshot().waiting == []  # not taken yet
    n = 0
    while engine.has_unfinished():
        for out in engine.step():
            n += len(out.new_token_ids)
        if n == 1:
            assert engine.snapshot().running[0].predicted_output_tokens == 3
    assert n == 7


# ---- routed cluster simulation ----------------------------------------------------------

LIMITS = {
    "max_num_seqs": 8,
    "max_num_batched_tokens": 256,
    "block_size": 16,
    "num_kv_blocks": 128,
    "max_model_len": 512,
}


def _sim_model(name: str, price: float, coefs: list[float], **quality: float) -> str:
    return table(
        f"models.{name}",
        engine="sim",
        price_input_per_mtok=price,
        price_output_per_mtok=price,
        batch_time_features="six-term",
        batch_time_coefs=coefs,
        quality=quality,
    )


TINY = (
    table("estimator", snapshot_max_age_s=2.0, snapshot_refresh_s=0.02)
    + _sim_model("small", 1.0, [0.01, 1e-4, 0.0, 1e-3, 0.0, 0.0], default=0.3)
    + _sim_model("big", 2.0, [0.05, 2e-3, 0.0, 5e-3, 0.0, 0.0], default=0.9, hard=0.95)
    + instance("small", LIMITS)
    + instance("big", LIMITS)
    + preset("auto", ["small", "big"])
)


def _requests(n: int, gap_s: float, prompt: int = 100, target_s: float = 0.3) -> list[SimRequest]:
    return [
        SimRequest(f"q{i}", i * gap_s, "hard" if i % 2 else "easy", prompt, 8, 8, 64, target_s)
        for i in range(n)
    ]


def test_single_request_ttft_is_dispatch_plus_its_prefill() -> None:
    cluster = parse_cluster(TINY)
    run = simulate_cluster(
        cluster,
        create_policy("latency-agnostic"),
        _requests(1, 0.0),
        lam=0.0,
        settings=ClusterSimSettings(dispatch_delay_s=0.002),
    )
    (o,) = run.outcomes
    assert o.model == "big"
    assert o.ttft_s == pytest.approx(0.002 + 0.05 + 100 * 2e-3)
    assert o.utility == pytest.approx(0.9)  # task "easy": the default quality
    assert run.on_time_utility() == pytest.approx(0.9)  # 0.252 s <= 0.3 s


def test_round_robin_alternates_and_runs_are_deterministic() -> None:
    cluster = parse_cluster(TINY)
    reqs = _requests(6, 0.5)
    a = simulate_cluster(cluster, create_policy("round-robin"), reqs, lam=0.0)
    b = simulate_cluster(cluster, create_policy("round-robin"), reqs, lam=0.0)
    assert [o.model for o in a.outcomes] == ["big", "small"] * 3  # sorted ids: big-0, small-0
    assert [o.ttft_s for o in a.outcomes] == [o.ttft_s for o in b.outcomes]


def test_sfs_constraint_diverts_a_burst_that_latency_agnostic_queues() -> None:
    """Eight requests at once: the big model takes ~0.45 s to prefill them all, past the
    0.3 s target for most; SFS sends the ones predicted late to the small model."""
    cluster = parse_cluster(TINY)
    reqs = _requests(8, 0.0)
    agnostic = simulate_cluster(cluster, create_policy("latency-agnostic"), reqs, lam=0.0)
    sfs = simulate_cluster(cluster, create_policy("sfs-constraint"), reqs, lam=0.0)
    assert {o.model for o in agnostic.outcomes} == {"big"}
    assert agnostic.attainment() < 1.0
    assert {o.model for o in sfs.outcomes} == {"big", "small"}
    assert sfs.attainment() == 1.0
    assert sfs.on_time_utility() > agnostic.on_time_utility()
    # every SFS prediction on the chosen instance meets the target (it had a feasible one)
    assert all(o.predicted_ttft_s <= o.request.ttft_target_s for o in sfs.outcomes)
    # OnTimeUtility by hand: utilities of the requests that met their target, over N
    want = sum(o.utility for o in agnostic.outcomes if o.ttft_s <= 0.3) / 8
    assert agnostic.on_time_utility() == pytest.approx(want)


def test_the_ledger_makes_a_burst_visible_before_any_snapshot_does() -> None:
    """Within one refresh tick no snapshot shows the earlier dispatches; the ledger
    does, so each prediction on the big model includes the requests sent before it."""
    cluster = parse_cluster(TINY)
    reqs = _requests(4, 0.001, target_s=10.0)  # every target feasible: all go big
    run = simulate_cluster(cluster, create_policy("sfs-constraint"), reqs, lam=0.0)
    assert {o.model for o in run.outcomes} == {"big"}
    predicted = [o.predicted_ttft_s for o in run.outcomes]
    assert predicted == sorted(predicted) and len(set(predicted)) == 4


def test_make_requests() -> None:
    tasks = {"a": [(10, 50)], "b": [(5000, 40)]}
    offsets = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]
    r1, r2 = (
        make_requests(
            offsets,
            tasks,
            random.Random(3),
            max_model_len=1000,
            ttft_target_s=default_ttft_target_s,
            length_error=0.3,
        )
        for _ in range(2)
    )
    assert r1 == r2  # the same seed, the same requests
    for r in r1:
        assert r.num_prompt_tokens + r.max_tokens <= 1000
        assert r.num_output_tokens <= r.max_tokens
        assert abs(r.predicted_output_tokens - r.num_output_tokens) <= 0.3 * r.num_output_tokens + 1
        assert r.ttft_target_s == default_ttft_target_s(r.num_prompt_tokens)
    long = [r for r in r1 if r.task == "b"]
    assert long and all(r.num_prompt_tokens == 999 and r.max_tokens == 1 for r in long)
    with pytest.raises(ValueError):
        make_requests(
            offsets,
            {"a": []},
            random.Random(0),
            max_model_len=10,
            ttft_target_s=default_ttft_target_s,
        )


def test_every_sim_setting_the_file_takes_builds_a_simulated_cluster() -> None:
    """[models.X.sim] may set any key of SIM_SETTINGS; those the cluster simulation sets
    itself (a virtual clock from 0, no samples) gave a duplicate-keyword TypeError."""
    from bench.cluster_sim import build_instances

    sim = '[models.small.sim]\nclock = "wall"\nstart_time_s = 5.0\nnum_batch_samples = 8\n'
    sim += "output_len_mean = 64.0\n"
    built = build_instances(parse_cluster(TINY + sim))
    small = [cfg for info, cfg, _ in built if info.model == "small"]
    assert small and all(
        (c.clock, c.start_time_s, c.num_batch_samples, c.output_len_mean)
        == ("virtual", 0.0, 1, 64.0)
        for c in small
    )
