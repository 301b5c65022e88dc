"""The time per output token from an instance's batch-time model."""

from __future__ import annotations

import pytest

from services.estimator.routebalance.tpot import FALLBACK_TPOT_S, decode_step_s
from shared.scheduling.batch_time import SIX_TERM, BatchTimeModel

# six-term: b0 + bp*P + bpp*PP + bd*D + bs*S + bs2*S2
MODEL = BatchTimeModel(SIX_TERM, (0.01, 0.0, 0.0, 0.002, 1e-5, 0.0))


def test_a_decode_step_costs_its_base_per_row_and_context() -> None:
    # 4 decodes at context 100: 0.01 + 4 * 0.002 + 1e-5 * 4 * 101
    assert decode_step_s(MODEL, 4, 100) == pytest.approx(0.01 + 0.008 + 1e-5 * 404)


def test_the_recent_speed_scales_it_and_no_model_falls_back() -> None:
    assert decode_step_s(MODEL, 1, 0, speed=2.0) == pytest.approx(2 * (0.01 + 0.002 + 1e-5))
    assert decode_step_s(None, 8, 500) == FALLBACK_TPOT_S
