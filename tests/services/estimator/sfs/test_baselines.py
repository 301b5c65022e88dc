"""The throughput estimator and the LPS queue model follow their formulas."""

from __future__ import annotations

import math

import pytest

from services.estimator.sfs.baselines import (
    LPS_WAIT_CAP_S,
    ArrivalRateEstimator,
    is_fresh,
    lps_ttft_s,
    lps_wait_s,
    outstanding_prefill_tokens,
    profile_throughput,
    throughput_ttft_s,
)
from services.estimator.sfs.replay import PendingRequest
from shared.scheduling.snapshot import BatchSample, take_snapshot
from tests.services.estimator.sfs.builders import make_scheduler, step


def test_lps_wait_matches_the_formula() -> None:
    # alpha = 3/s, mu = 4/s, k = 5: W = 0.75^5 / (4 - 3)
    assert lps_wait_s(3.0, 4.0, 5) == pytest.approx(0.75**5 / 1.0)
    assert lps_wait_s(1.0, 10.0, 2) == pytest.approx(0.01 / 9.0)
    assert lps_wait_s(0.0, 4.0, 3) == 0.0
    assert lps_wait_s(5.0, 4.0, 3) == LPS_WAIT_CAP_S  # rho >= 1: saturated
    assert math.isinf(lps_wait_s(4.0, 4.0, 3, cap_s=math.inf))
    assert lps_wait_s(3.9, 4.0, 0, cap_s=5.0) == 5.0  # 1 / 0.1 = 10 s, capped
    # The paper's point: more parallelism k shrinks the wait at the same load.
    assert lps_wait_s(3.0, 4.0, 25) < lps_wait_s(3.0, 4.0, 1)
    assert lps_ttft_s(3.0, 4.0, 5, 1000, 2000.0) == pytest.approx(0.75**5 + 0.5)


def test_throughput_estimator_matches_the_formula() -> None:
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=16)
    s.add("a", 4, 50)  # prefilled, then decodes: no prefill backlog
    step(s)
    s.add("b", 40, 5)  # running, 16 of 40 computed after the next step
    s.add("c", 30, 5)  # waiting: running cap
    step(s)
    snap = take_snapshot(s, 1, 0.0)
    assert outstanding_prefill_tokens(snap) == (40 - 15) + 30
    ledger = [PendingRequest("L", 12, 3), PendingRequest("c", 30, 5)]  # c is visible
    assert outstanding_prefill_tokens(snap, ledger) == 25 + 30 + 12
    got = throughput_ttft_s(snap, 100, prefill_tps=1000.0, mean_decode_step_s=0.02, pending=ledger)
    assert got == pytest.approx((67 + 100) / 1000.0 + 0.02)


def test_profile_throughput() -> None:
    samples = [
        BatchSample(0.0, 0.5, 1000, 0, [1000], [1000], 1, 0),
        BatchSample(0.0, 0.5, 500, 3, [500], [500, 9, 9, 9], 4, 0),
        BatchSample(0.0, 0.02, 0, 4, [], [9, 9, 9, 9], 4, 0),
        BatchSample(0.0, 0.04, 0, 4, [], [9, 9, 9, 9], 4, 0),
    ]
    prof = profile_throughput(samples)
    assert prof.prefill_tps == pytest.approx(1500 / 1.0)
    assert prof.mean_decode_step_s == pytest.approx(0.03)


def test_arrival_rate_ewma() -> None:
    est = ArrivalRateEstimator(window_s=1.0, weight=0.5)
    for t in (0.0, 0.1, 0.2, 0.3):
        est.observe(t)
    assert est.rate(0.9) == 0.0  # first window still open
    assert est.rate(1.0) == pytest.approx(0.5 * 4)
    assert est.rate(3.0) == pytest.approx(2.0 * 0.5 * 0.5)  # two empty windows


def test_staleness_bound() -> None:
    snap = take_snapshot(make_scheduler(), 1, 100.0)
    assert is_fresh(snap, 100.05, max_age_s=0.1)
    assert not is_fresh(snap, 100.5, max_age_s=0.1)
