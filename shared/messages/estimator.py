"""Messages to the estimator: route request/reply and request-done events."""

from __future__ import annotations

import msgspec


class RouteRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Which instance should serve this request? (request/reply on `estimator_route`)"""

    request_id: str  # minted by the gateway; the ledger is keyed by it
    model: str  # the name the client asked for: a real model or a routing preset
    num_prompt_tokens: int  # tokens, after the chat template
    max_tokens: int  # output tokens at most
    # the client's TTFT target (x-slo-ttft-ms); None: default rule
    ttft_target_ms: float | None = None
    task: str | None = None  # task name for the quality table (x-baton-task); None: "default"
    policy: str | None = None  # overrides the preset's policy (x-baton-policy); None: the preset's
    # RouteBalance's weights for this request (x-baton-weights); None: the preset's
    weights: list[float] | None = None
    budget: float | None = None  # the most it may cost, cost units (x-baton-budget)
    predicted_output_tokens: int | None = None  # tokens, when a predictor upstream knows
    # token ids of the prompt after the chat template: the length/quality predictors'
    # features (docs/predictors.md); None: not sent (the quality table and default apply)
    prompt_token_ids: list[int] | None = None


class RouteReply(msgspec.Struct, frozen=True, kw_only=True):
    """The decision. `instance_id` is None when no live instance serves the model."""

    request_id: str  # as in the request
    instance_id: str | None = None  # chosen worker instance
    model: str | None = None  # the real model that instance serves
    inbox: str | None = None  # subject to submit to (`subjects.worker_inbox`)
    error: str | None = None  # user-facing reason when instance_id is None
    retry_after_s: float = 1.0  # seconds a client should wait before retrying after an error
    policy: str | None = None  # the policy that decided
    predicted_ttft_ms: float | None = None  # ms, the chosen instance's predicted TTFT (if computed)
    predicted_ttft_source: str | None = None  # "sfs" (snapshot replay) | "lps" (queue model)
    predicted_output_tokens: int | None = None  # tokens, the length the decision assumed
    decision_ms: float | None = None  # ms the estimator spent deciding (no bus time)


class RequestDoneEvent(msgspec.Struct, frozen=True, kw_only=True):
    """A request has ended (finished, failed or aborted): drop it from every ledger.

    It also carries the SFS estimate its routing used and the TTFT the gateway
    measured, where there were such: with both, the feedback that corrects the
    instance's replay (sfs/correction.py)."""

    request_id: str  # as routed
    instance_id: str  # where it ran
    predicted_ttft_ms: float | None = None  # the SFS estimate its decision used, ms
    ttft_ms: float | None = None  # measured at the gateway: submit -> first token, ms


ROUTE_REQUEST_DECODER = msgspec.msgpack.Decoder(RouteRequest)
ROUTE_REPLY_DECODER = msgspec.msgpack.Decoder(RouteReply)
REQUEST_DONE_DECODER = msgspec.msgpack.Decoder(RequestDoneEvent)
