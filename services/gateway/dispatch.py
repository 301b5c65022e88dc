"""Route one prepared request and submit it to the instance chosen: for the handler's
first send (completions.handle) and for a reroute (Generation.first_event)."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import msgspec

from services.gateway.service import GatewayService
from services.gateway.streams import RequestStream
from shared.messages.estimator import RouteReply, RouteRequest
from shared.sampling import SamplingParams

if TYPE_CHECKING:
    from services.gateway.prepared import Prepared


def routed_defaults(service: GatewayService, p: Prepared, model: str | None) -> SamplingParams:
    """The request's sampling with what it left out taken from the model routing chose:
    a preset's models may recommend different values, and until routing the request
    holds its first model's (ClusterConfig.sampling_defaults)."""
    body, params = p.body, p.params
    defaults = None if model is None else service.sampling_defaults.get(model)
    if defaults is None or None not in (body.temperature, body.top_p):
        return params
    temperature = params.temperature if body.temperature is not None else defaults[0]
    top_p = params.top_p if body.top_p is not None else defaults[1]
    if (temperature, top_p) == (params.temperature, params.top_p):
        return params  # a real model, or the preset's first: nothing to change
    return msgspec.structs.replace(params, temperature=temperature, top_p=top_p)


async def send_routed(
    service: GatewayService, p: Prepared, avoid: frozenset[str] = frozenset()
) -> tuple[RouteReply, RequestStream, dict[str, Any]]:
    """Route the request (to none of `avoid`) and submit it: (the decision, the stream its
    events come on, the routing facts for the `baton` object)."""
    t_route = time.perf_counter()
    reply = await service.route(
        RouteRequest(
            request_id=p.request_id,
            model=p.body.model,
            num_prompt_tokens=len(p.prompt_token_ids),
            max_tokens=p.params.max_tokens,
            ttft_target_ms=p.ttft_target_ms,
            task=p.task,
            policy=p.policy,
            weights=p.weights,
            budget=p.budget,
            prompt_token_ids=p.prompt_token_ids,
        ),
        avoid,
    )
    router_overhead_ms = (time.perf_counter() - t_route) * 1000.0
    preset = service.cluster.presets.get(p.body.model)
    params = routed_defaults(service, p, reply.model)
    budget_max_tokens = None
    if p.budget is not None and reply.model is not None:
        params, budget_max_tokens = within_budget(service, p, reply.model, params)
    stream = await service.submit(
        reply,
        p.request_id,
        p.prompt_token_ids,
        params,
        p.arrival_time_s,
        preset=p.body.model if preset is not None and preset.is_token_level else None,
    )
    # Observed once the request is on its way (the label lookup and the histogram's lock
    # took ~56 us on cold caches, on the TTFT path before the submit).
    service.metrics.router_overhead_s.labels(reply.policy or "").observe(
        router_overhead_ms / 1000.0
    )
    baton = {
        "model": reply.model,
        "instance": reply.instance_id,
        "policy": reply.policy,
        "task": p.task,  # x-baton-task as the estimator's quality tables read it
        "router_overhead_ms": round(router_overhead_ms, 3),
        "decision_ms": None if reply.decision_ms is None else round(reply.decision_ms, 3),
        "predicted_ttft_ms": (
            None if reply.predicted_ttft_ms is None else round(reply.predicted_ttft_ms, 3)
        ),
    }
    if p.budget is not None:
        baton |= {"budget": p.budget, "budget_max_tokens": budget_max_tokens}
    return reply, stream, baton


def within_budget(
    service: GatewayService, p: Prepared, model: str, params: SamplingParams
) -> tuple[SamplingParams, int | None]:
    """`params` with max_tokens cut to what the budget pays for on `model` after the
    prompt, so the realised cost never exceeds it (and that cap, None when the
    request's own max_tokens is within it). At least one token: the gateway refused a
    budget no candidate could pay one token for."""
    prices = service.cluster.models[model]
    left = p.budget - prices.cost(len(p.prompt_token_ids), 0) if p.budget is not None else 0.0
    per_token = prices.cost(0, 1)
    if per_token <= 0:
        return params, None
    affordable = max(1, math.floor(left / per_token + 1e-9))
    if affordable >= params.max_tokens:
        return params, None
    return msgspec.structs.replace(params, max_tokens=affordable), affordable
