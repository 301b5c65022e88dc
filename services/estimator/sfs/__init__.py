"""SFS (Serving Framework Simulation) core for the estimator: batch-time models and
their robust fit, the scheduler replay that predicts TTFT/E2E from a snapshot, the
throughput and LPS-queue baselines, and the routing utilities. Pure: no I/O."""

from services.estimator.sfs.batch_time import (
    EIGHT_TERM,
    FOUR_TERM,
    SEVEN_TERM,
    SIX_TERM,
    BatchTimeModel,
    features,
)
from services.estimator.sfs.fit import FitResult, OnlineBatchTimeFitter, fit_batch_time
from services.estimator.sfs.replay import (
    OutputPolicy,
    PendingRequest,
    Probe,
    ReplayEstimate,
    SfsReplayer,
    estimate,
    replay_exact,
)

__all__ = [
    "EIGHT_TERM",
    "FOUR_TERM",
    "SEVEN_TERM",
    "SIX_TERM",
    "BatchTimeModel",
    "FitResult",
    "OnlineBatchTimeFitter",
    "OutputPolicy",
    "PendingRequest",
    "Probe",
    "ReplayEstimate",
    "SfsReplayer",
    "estimate",
    "features",
    "fit_batch_time",
    "replay_exact",
]
