"""Time per output token of an instance now, from the batch-time model it is calibrated
with (the estimator's online fit of its own telemetry, else the cluster file's): one
decode step of the batch it would run with the request added, at the request's mid-answer
context, scaled by its recent speed against the model. The paper trains an xgboost head
per tier on a load sweep; the batch-time model is fitted per instance on what it runs.
"""

from __future__ import annotations

from shared.scheduling.batch_time import BatchTimeModel, raw_from_chunks

FALLBACK_TPOT_S = 0.05  # an instance with no calibration at all: a slow CPU-class guess


def decode_step_s(
    model: BatchTimeModel | None, batch: int, context_tokens: int, speed: float = 1.0
) -> float:
    """Seconds of one decode step of `batch` requests at `context_tokens` each (> 0)."""
    if model is None:
        return FALLBACK_TPOT_S
    step = model.predict_raw(raw_from_chunks([(context_tokens, 1, True)] * max(1, batch)))
    return max(1e-6, step * speed)
