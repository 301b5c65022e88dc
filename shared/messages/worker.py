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


class AbortRequest(msgspec.Struct, tag="abort", frozen=True, kw_only=True):
    """Stop a request (client gone, timeout); the engine frees its KV at its next step."""

    request_id: str  # as in SubmitRequest


WorkerInbound = SubmitRequest | AbortRequest

WORKER_INBOUND_DECODER = msgspec.msgpack.Decoder(WorkerInbound)
