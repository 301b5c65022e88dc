"""Messages to a gateway, on its inbox subject (`subjects.gateway_inbox`).

A worker sends one `DeltaBatch` per engine iteration per gateway, holding the
events of every request that gateway owns. Deltas carry their position, so the
gateway merges them by position (duplicates dropped, gaps held back).
"""

from __future__ import annotations

import msgspec


class TokenDelta(msgspec.Struct, tag="delta", frozen=True, array_like=True):
    """New output tokens of one request (hot path: array_like keeps it small)."""

    request_id: str  # as minted by the gateway
    position: int  # index, in the output, of token_ids[0] (tokens before it were sent already)
    token_ids: list[int]  # new token ids, possibly empty on the final delta
    logprobs: list[float] | None  # natural-log probability of each new token, if asked for
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" at the end
    num_prompt_tokens: int  # tokens in the prompt as the engine counted them
    # token-level presets, on the final delta: output tokens written per real model
    tokens_by_model: dict[str, int] | None = None
    # per new token, its top-k (token id, natural-log probability) pairs, most likely
    # first; only when the request asked for k > 0 top logprobs
    top_logprobs: list[list[tuple[int, float]]] | None = None


class RequestFailed(msgspec.Struct, tag="failed", frozen=True, array_like=True):
    """The worker rejected or lost a request; it will send nothing more for it."""

    request_id: str  # as minted by the gateway
    status: int  # HTTP status the gateway should answer with (400 bad input, 503 unavailable)
    message: str  # user-facing explanation


GatewayEvent = TokenDelta | RequestFailed


class DeltaBatch(msgspec.Struct, frozen=True, kw_only=True):
    """Everything one worker iteration produced for one gateway."""

    instance_id: str  # the worker instance that sent it
    step: int  # the worker's iteration number (monotonic per worker process)
    events: list[GatewayEvent]  # in the order the engine produced them


DELTA_BATCH_DECODER = msgspec.msgpack.Decoder(DeltaBatch)
