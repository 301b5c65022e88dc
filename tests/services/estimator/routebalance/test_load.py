"""An instance's load from its snapshot and the ledger, dead reckoning, and the E2E
formula."""

from __future__ import annotations

import pytest

from services.estimator.ledger import LedgerEntry
from services.estimator.routebalance.latency import e2e_s
from services.estimator.routebalance.load import InstanceLoad, load_of
from services.estimator.sfs.output_policy import OutputPolicy
from shared.scheduling.scheduler import SchedulerConfig
from shared.scheduling.snapshot import WorkloadSnapshot


def snapshot() -> WorkloadSnapshot:
    """Two running requests (one mid-prefill) and one waiting."""
    return WorkloadSnapshot(
        version=1,
        wall_time_s=0.0,
        scheduler=SchedulerConfig(max_num_seqs=4),
        num_free_blocks=10,
        num_running=2,
        num_pending=0,
        request_ids=["r1", "r2", "w1"],
        arrival_seqs=[0, 1, 2],
        prompt_tokens=[100, 50, 30],
        output_tokens=[10, 0, 0],
        computed_tokens=[110, 20, 0],
        max_tokens=[64, 64, 64],
        predicted_output_tokens=[40, -1, 200],
        num_blocks=[2, 1, 0],
        priority=[False, False, False],
    )


def test_the_snapshot_and_the_unseen_dispatches_make_the_load() -> None:
    unseen = [LedgerEntry("u1", "i", 70, 32, 0.0, None), LedgerEntry("u2", "i", 5, 32, 0.0, 8)]
    load = load_of("i", "m", 4, snapshot(), unseen, OutputPolicy(default_output_tokens=16))
    assert (load.num_running, load.num_waiting, load.num_requests) == (2, 3, 5)
    # decode still to do: r1 40-10, r2 default 16, w1 capped at 64, u1 default 16, u2 8
    assert load.pending_decode_tokens == 30 + 16 + 64 + 16 + 8
    assert not load.has_free_slot and load.decode_batch == 4


def test_without_a_snapshot_only_the_ledger_counts() -> None:
    load = load_of("i", "m", 4, None, [LedgerEntry("u", "i", 7, 9, 0.0, 3)], OutputPolicy())
    assert (load.num_running, load.num_waiting, load.pending_decode_tokens) == (0, 1, 3)


def test_dead_reckoning_adds_the_assigned_request() -> None:
    load = InstanceLoad("i", "m", 2)
    load.add(20, order=5)
    assert (load.num_waiting, load.pending_decode_tokens) == (1, 20)
    assert load.last_assigned == 5 and load.has_free_slot
    load.add(5, order=6)
    assert not load.has_free_slot


def test_e2e_is_the_own_decode_with_a_free_slot_else_behind_the_pending_decode() -> None:
    free = InstanceLoad("i", "m", 4, num_running=1, pending_decode_tokens=100)
    assert e2e_s(free, 0.01, 50) == pytest.approx(0.5)
    full = InstanceLoad("i", "m", 2, num_running=2, pending_decode_tokens=100)
    assert e2e_s(full, 0.01, 50) == pytest.approx(0.01 * (100 / 2 + 50))
