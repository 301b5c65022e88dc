"""Latency-aware routing, pure parts: utility policies, SFS vs queue model, ledger, config, headers."""

from __future__ import annotations

import math

import msgspec
import pytest

from bench.sfs_evaluation import estimate_from_now
from services.estimator.instances import LatencyEstimator, TtftEstimate, create_instance_state
from services.estimator.ledger import Ledger, LedgerEntry
from services.estimator.policies import InstanceView, Scores, UtilityPolicy, create_policy
from services.estimator.sfs.output_policy import OutputPolicy
from services.estimator.sfs.replay import Probe
from services.estimator.sfs.utility import default_ttft_target_s
from services.gateway.errors import GatewayError
from services.gateway.request_checks import RoutingHeaders, routing_headers
from shared.config import ConfigError, EstimatorConfig, ModelConfig, parse_cluster
from shared.messages.estimator import RouteRequest
from shared.scheduling.batch_time import SIX_TERM, BatchTimeModel
from shared.scheduling.snapshot import RequestCounters, WorkloadSnapshot
from tests.shared.scheduling.builders import limits
from tests.support.builders import worker_info

MODEL = BatchTimeModel(SIX_TERM, (0.01, 1e-4, 0.0, 1e-3, 0.0, 0.0))
SETTINGS = EstimatorConfig(snapshot_max_age_s=1.0)


def req(target_ms: float | None = None, prompt: int = 100) -> RouteRequest:
    return RouteRequest(
        request_id="q", model="m", num_prompt_tokens=prompt, max_tokens=64, ttft_target_ms=target_ms
    )


def view(iid: str, acc: float, cost: float, ttft_s: float) -> InstanceView:
    return InstanceView(worker_info(iid), None, [], Scores(acc, cost, ttft_s, "sfs"))


def snapshot(num_running: int, num_waiting: int = 0, wall_time_s: float = 0.0) -> WorkloadSnapshot:
    running = [RequestCounters(f"r{i}", i, 100, 5, 104, 64, 64) for i in range(num_running)]
    waiting = [
        RequestCounters(f"w{i}", num_running + i, 500, 0, 0, 64, 64) for i in range(num_waiting)
    ]
    return WorkloadSnapshot.from_rows(
        version=1,
        wall_time_s=wall_time_s,
        num_free_blocks=1024 - 7 * num_running,
        running=running,
        waiting=waiting,
        batch_time_features=MODEL.feature_set,
        batch_time_coefs=list(MODEL.coefs),
        scheduler=limits(seqs=4, budget=512, blocks=1024, context=4096),
    )


# ---- policies pick as the formulas say ------------------------------------------


def pick(
    name: str,
    views: list[InstanceView],
    lam: float = 0.0,
    delta: float = 0.0,
    target_ms: float | None = None,
) -> str:
    """The instance policy `name` (with `lam` and `delta`) picks for req(target_ms)."""
    policy = UtilityPolicy(name, lam, delta, default_ttft_target_s)
    return policy.choose(req(target_ms), views).instance_id


def test_latency_agnostic_maximises_accuracy_minus_lambda_cost() -> None:
    accurate, cheap = view("a", 0.9, 10.0, 5.0), view("b", 0.5, 1.0, 0.01)
    assert pick("latency-agnostic", [cheap, accurate]) == "a"
    # lambda = 0.1: 0.9 - 1.0 < 0.5 - 0.1
    assert pick("latency-agnostic", [accurate, cheap], lam=0.1) == "b"


def test_sfs_constraint_best_utility_among_feasible_else_fastest() -> None:
    policy = UtilityPolicy("sfs-constraint", 0.0, 0.0, default_ttft_target_s)
    slow_good, fast_poor, mid = (
        view("a", 0.9, 0, 2.0),
        view("b", 0.5, 0, 0.05),
        view("c", 0.7, 0, 0.3),
    )
    # The request's own target: 0.5 s admits b and c; c is the better of them.
    assert policy.choose(req(500), [slow_good, fast_poor, mid]).instance_id == "c"
    # Default rule (158 ms for 100 prompt tokens): only b is feasible.
    assert policy.choose(req(None), [slow_good, fast_poor, mid]).instance_id == "b"
    # Nobody meets 1 ms: the smallest predicted TTFT wins.
    assert policy.choose(req(1), [slow_good, mid, fast_poor]).instance_id == "b"
    # A generous target: the most accurate.
    assert policy.choose(req(10_000), [slow_good, fast_poor, mid]).instance_id == "a"


def test_utility_ties_go_to_the_replica_holding_fewer_requests() -> None:
    """Replicas of one model tie on utility: the less loaded one is asked first and,
    meeting the target, chosen (by id alone the first replica took every request while
    it met the target); equal loads fall back to the smallest id."""
    busy = InstanceView(worker_info("a"), snapshot(3, 2), [], Scores(0.9, 0, 0.10, "sfs"))
    idle = InstanceView(worker_info("b"), snapshot(0), [], Scores(0.9, 0, 0.02, "sfs"))
    pending = [LedgerEntry("x", "c", 500, 64, 0.0, 64)]  # one dispatch, no snapshot yet
    queued = InstanceView(worker_info("c"), None, pending, Scores(0.9, 0, 0.02, "sfs"))
    for name in ("latency-agnostic", "sfs-constraint", "sfs-lagrangian"):
        policy = UtilityPolicy(name, 0.0, 0.0, default_ttft_target_s)
        assert policy.choose(req(500), [busy, idle]).instance_id == "b", name
        assert policy.choose(req(500), [busy, queued]).instance_id == "c", name  # ledger counts
    twin = InstanceView(worker_info("d"), snapshot(0), [], Scores(0.9, 0, 0.02, "sfs"))
    assert pick("sfs-constraint", [twin, idle], target_ms=500) == "b"


def test_sfs_lagrangian_trades_utility_against_ttft() -> None:
    a, b = view("a", 0.9, 0, 1.0), view("b", 0.5, 0, 0.1)
    # delta = 0.1/s: 0.9 - 0.1 > 0.5 - 0.01; delta = 1/s: 0.9 - 1 < 0.5 - 0.1
    assert pick("sfs-lagrangian", [a, b], delta=0.1) == "a"
    assert pick("sfs-lagrangian", [a, b], delta=1.0) == "b"


def test_a_policy_computes_only_the_ttfts_it_needs_and_each_once() -> None:
    calls: list[str] = []

    def lazy(iid: str, acc: float, ttft_s: float) -> InstanceView:
        def estimate() -> TtftEstimate:
            calls.append(iid)
            return TtftEstimate(ttft_s, "sfs")

        return InstanceView(worker_info(iid), None, [], Scores(acc, 0.0, estimate=estimate))

    views = [lazy("a", 0.9, 0.1), lazy("b", 0.7, 0.05), lazy("c", 0.5, 0.01)]
    policy = UtilityPolicy("sfs-constraint", 0.0, 0.0, default_ttft_target_s)
    chosen = policy.choose(req(500), views)
    # a has the best utility and meets 0.5 s: b's and c's replays never run
    assert chosen.instance_id == "a" and calls == ["a"]
    assert chosen.scores is not None and chosen.scores.ttft_s == 0.1
    assert chosen.scores.ttft_source == "sfs" and calls == ["a"]  # memoised
    assert [v.scores.ttft_known for v in views if v.scores] == [True, False, False]
    calls.clear()
    views = [lazy("a", 0.9, 2.0), lazy("b", 0.7, 0.05), lazy("c", 0.5, 0.01)]
    assert policy.choose(req(500), views).instance_id == "b" and calls == ["a", "b"]
    # latency-agnostic never reads a TTFT
    calls.clear()
    agnostic = UtilityPolicy("latency-agnostic", 0.0, 0.0, default_ttft_target_s)
    assert agnostic.choose(req(500), views).instance_id == "a" and calls == []


def test_create_policy_runs_the_utility_policies_and_leaves_routebalance_to_its_batches() -> None:
    for name in ("latency-agnostic", "sfs-constraint", "sfs-lagrangian"):
        policy = create_policy(name, 0.1, 0.2)
        assert policy.name == name and policy.needs_scores
        assert policy.needs_ttft == (name != "latency-agnostic")
    with pytest.raises(ValueError, match="routebalance"):
        create_policy("routebalance")


def test_model_accuracy_per_task_and_cost_from_prices() -> None:
    m = ModelConfig(
        quality={"default": 0.6, "math": 0.9},
        price_input_per_mtok=1.0,
        price_output_per_mtok=4.0,
    )
    assert m.accuracy("math") == 0.9 and m.accuracy("poetry") == 0.6 and m.accuracy(None) == 0.6
    assert m.cost(1000, 500) == pytest.approx((1000 * 1.0 + 500 * 4.0) / 1e6)
    assert ModelConfig().accuracy(None) == 0.0


# ---- TTFT: SFS replay on fresh snapshots, LPS queue model otherwise ----------------


def test_fresh_snapshot_is_replayed_stale_and_missing_use_the_queue_model() -> None:
    latency = LatencyEstimator(SETTINGS)
    snap = snapshot(4, num_waiting=3)
    probe = Probe(100, 16, 64)
    fresh = create_instance_state(worker_info("a"), None, SETTINGS)
    fresh.snapshot, fresh.snapshot_wall_time_s = snap, 100.0
    latency.prepare(fresh)
    est = latency.ttft(fresh, probe, [], now_wall_s=100.5, now_mono_s=0.0)
    assert est.source == "sfs"
    # in-flight-aware: the snapshot's next iteration runs since 100.0 (evaluation.py)
    policy = OutputPolicy(SETTINGS.default_output_tokens)
    want = estimate_from_now(snap, MODEL, probe, [], 0.5, policy=policy).ttft_s
    assert est.ttft_s == pytest.approx(want)

    est_stale = latency.ttft(fresh, probe, [], now_wall_s=101.5, now_mono_s=0.0)
    assert est_stale.source == "lps" and math.isfinite(est_stale.ttft_s)

    missing = create_instance_state(worker_info("b"), None, SETTINGS)
    est_missing = latency.ttft(missing, probe, [], now_wall_s=0.0, now_mono_s=0.0)
    assert est_missing.source == "lps" and est_missing.ttft_s > 0


def test_the_snapshot_speed_scales_the_estimate_faded_with_the_wait() -> None:
    """A snapshot at speed s (its latest iterations ran s x its calibration) scales an SFS
    estimate T by s ** exp(-T / speed_horizon_s); horizon 0 or no carried calibration:
    unscaled."""
    probe = Probe(100, 16, 64)
    base = snapshot(4, num_waiting=3)

    def estimate(snap: WorkloadSnapshot, settings: EstimatorConfig) -> float:
        latency = LatencyEstimator(settings)
        state = create_instance_state(worker_info("a"), ModelConfig(), settings)
        state.config_model = MODEL
        state.snapshot, state.snapshot_wall_time_s = snap, 100.0
        est = latency.ttft(state, probe, [], now_wall_s=100.0, now_mono_s=0.0)
        assert est.source == "sfs"
        return est.ttft_s

    plain = estimate(base, SETTINGS)
    slow = estimate(msgspec.structs.replace(base, batch_time_speed=1.5), SETTINGS)
    fast = estimate(msgspec.structs.replace(base, batch_time_speed=0.5), SETTINGS)
    weight = math.exp(-plain / SETTINGS.speed_horizon_s)
    assert slow == pytest.approx(plain * 1.5**weight)
    assert fast == pytest.approx(plain * 0.5**weight)
    assert fast < plain < slow
    off = msgspec.structs.replace(SETTINGS, speed_horizon_s=0.0)
    assert estimate(msgspec.structs.replace(base, batch_time_speed=1.5), off) == plain
    # No carried calibration: the speed is against nothing the estimator prices with.
    bare = msgspec.structs.replace(
        base, batch_time_features="", batch_time_coefs=[], batch_time_speed=1.5
    )
    assert estimate(bare, SETTINGS) == pytest.approx(plain)


def test_an_old_writers_snapshot_decodes_at_speed_one() -> None:
    fields = msgspec.to_builtins(msgspec.structs.replace(snapshot(2), batch_time_speed=1.5))
    del fields["batch_time_speed"]
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(fields), type=WorkloadSnapshot)
    assert old.batch_time_speed == 1.0


def test_queue_model_grows_with_the_arrival_rate() -> None:
    latency = LatencyEstimator(SETTINGS)
    probe = Probe(100, 64, 64)
    idle = create_instance_state(
        worker_info("a", "m"),
        ModelConfig(batch_time_features=SIX_TERM, batch_time_coefs=list(MODEL.coefs)),
        SETTINGS,
    )
    busy = create_instance_state(
        worker_info("b", "m"),
        ModelConfig(batch_time_features=SIX_TERM, batch_time_coefs=list(MODEL.coefs)),
        SETTINGS,
    )
    for i in range(200):  # 20 dispatches/s for 10 s
        busy.arrivals.observe(i * 0.05)
    t_idle = latency.ttft(idle, probe, [], 0.0, 10.0).ttft_s
    t_busy = latency.ttft(busy, probe, [], 0.0, 10.0).ttft_s
    assert t_idle == pytest.approx(
        100 / (100 / MODEL.predict_features([1, 100, 10_000, 0, 100, 10_000]))
    )
    assert t_busy > t_idle


def test_ledger_entries_are_counted_once() -> None:
    """A dispatch the snapshot already shows adds nothing; an unseen one waits in the replay."""
    latency = LatencyEstimator(SETTINGS)
    snap = snapshot(4, num_waiting=1)
    state = create_instance_state(worker_info("a"), None, SETTINGS)
    state.snapshot, state.snapshot_wall_time_s = snap, 0.0
    latency.prepare(state)
    probe = Probe(100, 16, 64)
    base = latency.ttft(state, probe, [], 0.0, 0.0).ttft_s
    seen = LedgerEntry("w0", "a", 500, 64, 0.0, 64)  # the snapshot's waiting request
    unseen = LedgerEntry("new", "a", 500, 64, 0.0, 64)
    assert latency.ttft(state, probe, [seen], 0.0, 0.0).ttft_s == base
    with_unseen = latency.ttft(state, probe, [unseen], 0.0, 0.0).ttft_s
    assert with_unseen > base
    assert latency.ttft(state, probe, [unseen, unseen, seen], 0.0, 0.0).ttft_s == with_unseen

    ledger = Ledger(ttl_s=60)
    ledger.add(seen)
    ledger.add(unseen)
    ledger.add(unseen)  # re-adding an id replaces it
    assert len(ledger) == 2
    ledger.reconcile("a", {r.request_id for r in snap.waiting})
    assert [e.request_id for e in ledger.pending("a")] == ["new"]


def test_visible_ids_follow_the_snapshot_however_it_was_set() -> None:
    """`InstanceState.visible` is built on first use; it never outlives its snapshot."""
    state = create_instance_state(worker_info("a"), None, SETTINGS)
    assert state.visible == frozenset()
    state.take_snapshot(snapshot(2), (1, 0.0))
    assert state.visible == {"r0", "r1"}
    state.take_snapshot(snapshot(1, num_waiting=1), (2, 0.0))
    assert state.visible == {"r0", "w0"}
    state.snapshot = snapshot(3)  # set directly (tests, the benchmark): rebuilt too
    assert state.visible == {"r0", "r1", "r2"}


def test_batch_time_model_prefers_the_snapshot_then_the_fit_then_the_config() -> None:
    cfg = ModelConfig(batch_time_features=SIX_TERM, batch_time_coefs=[1.0, 0, 0, 0, 0, 0])
    state = create_instance_state(worker_info("a"), cfg, SETTINGS)
    assert state.batch_time_model() == BatchTimeModel(SIX_TERM, (1.0, 0, 0, 0, 0, 0))
    state.snapshot = msgspec.structs.replace(
        snapshot(1), batch_time_features="", batch_time_coefs=[]
    )
    assert state.batch_time_model() == state.config_model
    state.snapshot = snapshot(1)
    assert state.batch_time_model() == MODEL


# ---- configuration and headers ----------------------------------------------------

PRESETS = """
[estimator]
policy = "sfs-lagrangian"
lambda = 0.5
delta = 2.0

[models.m]
engine = "torch"
quality = {{ default = 0.5 }}

[presets.auto]
models = ["m"]
policy = "{policy}"
lambda = {lam}
delta = 0.25
"""


def test_cluster_file_lambda_and_delta() -> None:
    cfg = parse_cluster(PRESETS.format(policy="sfs-constraint", lam=3.0))
    assert cfg.presets["auto"].lambda_ == 3.0 and cfg.presets["auto"].delta == 0.25
    assert cfg.estimator.lambda_ == 0.5 and cfg.estimator.delta == 2.0
    with pytest.raises(ConfigError, match="lambda"):
        parse_cluster(PRESETS.format(policy="sfs-constraint", lam=-1.0))


def test_routing_headers() -> None:
    assert routing_headers({}) == RoutingHeaders()
    assert routing_headers(
        {
            "x-slo-ttft-ms": "250",
            "x-baton-task": "math",
            "x-baton-policy": "sfs-constraint",
            "x-baton-weights": "0.5, 0.25,0.25",
            "x-baton-budget": "0.002",
        }
    ) == RoutingHeaders(250.0, "math", "sfs-constraint", [0.5, 0.25, 0.25], 0.002)
    for bad in (
        {"x-slo-ttft-ms": "soon"},
        {"x-slo-ttft-ms": "-3"},
        {"x-baton-policy": "best-route"},
        {"x-baton-weights": "0.5,0.5"},  # two weights
        {"x-baton-weights": "0.5,0.6,0.1"},  # off the simplex
        {"x-baton-weights": "1,-0.5,0.5"},  # negative
        {"x-baton-weights": "a,b,c"},
        {"x-baton-budget": "0"},
        {"x-baton-budget": "cheap"},
    ):
        with pytest.raises(GatewayError) as exc:
            routing_headers(bad)
        assert exc.value.status == 400
