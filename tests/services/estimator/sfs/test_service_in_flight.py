"""The estimator service's SFS estimate is the in-flight-aware one of `evaluation.py`."""

from __future__ import annotations

import random

import msgspec
import pytest

from bench.sfs_evaluation import estimate_from_now
from services.estimator.instances import LatencyEstimator, create_instance_state
from services.estimator.ledger import LedgerEntry
from services.estimator.sfs.output_policy import OutputPolicy
from services.estimator.sfs.replay import Probe, estimate
from services.worker.engine.sim import SimEngine
from shared.config import EstimatorConfig, ModelConfig
from shared.scheduling.batch_time import SIX_TERM, BatchTimeModel
from shared.scheduling.snapshot import WorkloadSnapshot, take_snapshot
from tests.services.estimator.sfs.builders import (
    MODEL,
    SIM_CFG,
    SIM_MODEL,
    make_scheduler,
    query_ttft,
    random_live,
    three_decodes_s,
    three_decoding,
)
from tests.support.builders import worker_info

SETTINGS = EstimatorConfig(snapshot_max_age_s=5.0, default_output_tokens=32)
INFO = worker_info("a")
CONFIG = ModelConfig(batch_time_features=SIX_TERM, batch_time_coefs=list(MODEL.coefs))


def service_estimate(
    snap_wall_s: float,
    now_wall_s: float,
    live: WorkloadSnapshot,
    probe: Probe,
    ledger: list[LedgerEntry],
) -> float:
    latency = LatencyEstimator(SETTINGS)
    state = create_instance_state(INFO, CONFIG, SETTINGS)
    state.snapshot, state.snapshot_wall_time_s = live, snap_wall_s
    latency.prepare(state)
    est = latency.ttft(state, probe, ledger, now_wall_s, now_mono_s=0.0)
    assert est.source == "sfs"
    return est.ttft_s


def test_hand_made_case_equals_the_in_flight_aware_estimate() -> None:
    """Two running requests, one waiting; one dispatch before the snapshot's time that
    it does not show (`joined`), one after (`pending`); the probe arrives 4 ms late."""
    s = make_scheduler(max_num_seqs=4, max_num_batched_tokens=32)
    s.add("run0", 20, 10, 8)
    s.add("run1", 12, 10, 4)
    for _ in range(2):  # both admitted and prefilling
        batch = s.schedule()
        s.commit(batch)
    s.add("wait0", 30, 6, 6)
    snap = take_snapshot(s, 7, 100.0)
    early = LedgerEntry("early", "a", 16, 8, 99.99, 5)  # decided before the snapshot
    late = LedgerEntry("late", "a", 24, 8, 100.002, 3)  # decided after it
    probe = Probe(10, 5, 20)
    age = 0.004
    want = estimate_from_now(
        snap, MODEL, probe, [late], age, joined=[early], policy=OutputPolicy(32)
    )
    assert want.in_flight_s > age > 0  # the in-flight part counts
    got = service_estimate(100.0, 100.0 + age, snap, probe, [early, late])
    assert got == pytest.approx(want.ttft_s, rel=1e-12)
    # ... and differs from the estimate counted from the snapshot's time
    old = estimate(snap, MODEL, probe, [early, late], policy=OutputPolicy(32)).ttft_s
    assert got != pytest.approx(old)


@pytest.mark.parametrize("seed", range(20))
def test_random_cases_equal_the_in_flight_aware_estimate(seed: int) -> None:
    rng = random.Random(seed)
    live = random_live(rng, predicted=rng.random() < 0.5, peer=rng.random() < 0.3)
    snap = take_snapshot(live, 1, 50.0)
    times = sorted(50.0 + rng.uniform(-0.02, 0.02) for _ in range(rng.randint(0, 4)))
    ledger = [  # in dispatch order, as the ledger keeps it
        LedgerEntry(f"n{i}", "a", rng.randint(1, 40), rng.randint(1, 40), t)
        for i, t in enumerate(times)
    ]
    probe = Probe(rng.randint(1, 40), rng.randint(1, 20), 40)
    age = rng.choice([0.0, 0.003, 1.0])
    joined = [e for e in ledger if e.dispatched_at_s < 50.0]
    after = [e for e in ledger if e.dispatched_at_s >= 50.0]
    try:
        want = estimate_from_now(
            snap,
            MODEL,
            probe,
            after,
            age,
            joined=joined,
            pending_offsets_s=[e.dispatched_at_s - 50.0 for e in after],
            policy=OutputPolicy(32),
        )
    except ValueError:
        pytest.skip("snapshot not replayable")
    assert service_estimate(50.0, 50.0 + age, snap, probe, ledger) == pytest.approx(
        want.ttft_s, rel=1e-12
    )


@pytest.mark.parametrize("steps_since", [0.3, 1.5, 2.6])
@pytest.mark.parametrize("speed", [0.8, 1.25])
def test_an_engine_off_its_model_by_its_recent_speed_is_predicted_exactly(
    speed: float, steps_since: float
) -> None:
    """A SimEngine whose every iteration takes `speed` times the model's (the snapshot
    carries the model and that speed) runs on after its snapshot; a query arrives
    `steps_since` of its iterations later. With the speed's fade switched off (an
    infinite horizon) the service's estimate equals the TTFT the engine gives: the
    elapsed time is put on the model's clock before the in-flight remainder is taken,
    not scaled with it."""
    base = SIM_MODEL
    slow = BatchTimeModel(SIX_TERM, tuple(c * speed for c in base.coefs))
    engine = SimEngine(SIM_CFG, slow)
    live, t_snap = three_decoding(engine)
    snap = msgspec.structs.replace(
        live,
        batch_time_features=SIX_TERM,
        batch_time_coefs=list(base.coefs),
        batch_time_speed=speed,
    )
    decode_s = three_decodes_s(slow)
    arrival = t_snap + steps_since * decode_s
    measured = query_ttft(engine, arrival)
    settings = EstimatorConfig(
        snapshot_max_age_s=60.0, default_output_tokens=10**6, speed_horizon_s=1e12
    )
    latency = LatencyEstimator(settings)
    state = create_instance_state(INFO, None, settings)
    state.snapshot, state.snapshot_wall_time_s = snap, t_snap
    latency.prepare(state)
    est = latency.ttft(state, Probe(12, 5, 5), [], arrival, now_mono_s=0.0)
    assert est.source == "sfs"
    assert est.ttft_s == pytest.approx(measured, rel=1e-6)
