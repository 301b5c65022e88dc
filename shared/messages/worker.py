"""Messages to a worker, on its inbox subject (`subjects.worker_inbox`)."""

from __future__ import annotations

import msgspec

from shared.sampling import SamplingParams


class SubmitRequest(msgspec.Struct, tag="submit", frozen=True, kw_only=True):
    """Start generating for one request; deltas go to `reply_to`."""

    request_id: str  # minted by the gateway, unique across the deployment
    prompt_token_ids: list[int]  # token ids, chat template already applied
    params: SamplingParams  # decoding settings, validated by the gateway
    reply_to: str  # subject of the owning gateway's inbox
    arrival_time_s: float  # gateway wall clock (time.time()) when the HTTP request arrived
    # tokens, the router's length prediction (snapshots carry it)
    predicted_output_tokens: int | None = None
    preset: str | None = None  # the token-level preset the client named; None: plain request
    # the owning gateway's id (`keys.gateway`): the worker aborts the request once that
    # registration has been gone a while (the gateway died); "": never
    owner: str = ""


class AbortRequest(msgspec.Struct, tag="abort", frozen=True, kw_only=True):
    """Stop a request (client gone, timeout); the engine frees its KV at its next step."""

    request_id: str  # as in SubmitRequest


WorkerInbound = SubmitRequest | AbortRequest


class BatchTimeCalibration(msgspec.Struct, frozen=True, kw_only=True):
    """Batch-time coefficients the estimator fitted for one instance (Redis `keys.calibration`).

    The worker copies feature_set/coefs into every snapshot it writes, so a replay
    always prices with the calibration the publisher carried.
    """

    feature_set: str  # name of the feature set (shared/scheduling/batch_time.py)
    coefs: list[float]  # seconds per feature unit
    mape: float  # fraction, fit error over inlier samples
    mape_all: float  # fraction, fit error over every sample (stalls included)
    num_samples: int  # samples in the fit window
    fitted_at_s: float  # estimator wall clock (time.time()) of the fit


WORKER_INBOUND_DECODER = msgspec.msgpack.Decoder(WorkerInbound)
CALIBRATION_DECODER = msgspec.msgpack.Decoder(BatchTimeCalibration)
