"""The checks of a completion request's fields that need no worker and no tokenizer:
one 400 naming the field (OpenAI's `param`) for each thing Baton refuses, the routing
headers, and the sampling parameters the request asks for.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from services.gateway.errors import GatewayError
from services.gateway.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from shared.config import POLICY_NAMES
from shared.sampling import MAX_TOP_LOGPROBS, SamplingParams


def bad_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, "invalid_request_error", code, param)


_AT = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MISSING = re.compile(r"missing required field `(?P<field>[^`]+)`")


def validation_param(message: str) -> str | None:
    """The field a msgspec ValidationError names, as OpenAI's `param`: "Expected `int`,
    got `str` - at `$.max_tokens`" -> "max_tokens"; "Object missing required field
    `role` - at `$.messages[0]`" -> "messages[0].role"; None when it names none."""
    at = _AT.search(message)
    path = at["path"] if at else ""
    missing = _MISSING.search(message)
    if missing:
        path = f"{path}.{missing['field']}" if path else missing["field"]
    return path or None


# Routing headers a client may send (llm-d's x-slo-ttft-ms; Baton's own x-baton-*).
SLO_TTFT_HEADER = "x-slo-ttft-ms"  # the request's TTFT target, milliseconds
TASK_HEADER = "x-baton-task"  # task name for the models' quality tables
POLICY_HEADER = "x-baton-policy"  # overrides the preset's routing policy
WEIGHTS_HEADER = "x-baton-weights"  # RouteBalance's weights: quality,latency,cost[,balance]
BUDGET_HEADER = "x-baton-budget"  # the most the request may cost, in the models' cost units


@dataclass(frozen=True, slots=True)
class RoutingHeaders:
    ttft_target_ms: float | None = None
    task: str | None = None
    policy: str | None = None
    weights: list[float] | None = None
    budget: float | None = None


def routing_headers(headers: Mapping[str, str]) -> RoutingHeaders:
    """What the request's routing headers ask for; 400 when one is malformed."""
    ttft = _positive(headers, SLO_TTFT_HEADER, "a positive number of milliseconds")
    task = headers.get(TASK_HEADER) or None
    policy = headers.get(POLICY_HEADER) or None
    if policy is not None and policy not in POLICY_NAMES:
        raise bad_request(
            f"header {POLICY_HEADER} must be one of {', '.join(POLICY_NAMES)}, got {policy!r}",
            POLICY_HEADER,
        )
    budget = _positive(headers, BUDGET_HEADER, "a positive cost")
    weights = _weights(headers.get(WEIGHTS_HEADER))
    return RoutingHeaders(ttft, task, policy, weights, budget)


def _positive(headers: Mapping[str, str], name: str, what: str) -> float | None:
    """The header as a finite number > 0 (None when absent); 400 naming it otherwise."""
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (0 < value < float("inf")):
        raise bad_request(f"header {name} must be {what}, got {raw!r}", name)
    return value


def _weights(raw: str | None) -> list[float] | None:
    """x-baton-weights: 3 or 4 comma-separated non-negative numbers summing to 1."""
    if raw is None or not raw.strip():
        return None
    try:
        weights = [float(w) for w in raw.split(",")]
    except ValueError:
        weights = []
    if (
        len(weights) not in (3, 4)
        or not all(0 <= w < float("inf") for w in weights)
        or abs(sum(weights) - 1.0) > 1e-6
    ):
        raise bad_request(
            f"header {WEIGHTS_HEADER} must be 3 (quality,latency,cost) or 4 (+ balance) "
            f"non-negative numbers summing to 1, got {raw!r}",
            WEIGHTS_HEADER,
        )
    return weights


def refuse_unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    """A 400 for a request field that asks for something Baton does not do (structured
    output, function calling, logit bias, best_of, suffix): answering as if the field
    were absent would hand the client an answer of another kind than it asked for.
    Empty or neutral values (tools [] or tool_choice "none", response_format "text",
    logit_bias {}, best_of 1, min_tokens 0, repetition_penalty 1, reasoning_effort
    "none") are served."""
    if body.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if body.min_tokens:
        raise bad_request("min_tokens is not supported", "min_tokens")
    if body.repetition_penalty is not None and body.repetition_penalty != 1.0:
        raise bad_request(
            "repetition_penalty is not supported: use frequency_penalty or presence_penalty",
            "repetition_penalty",
        )
    if isinstance(body, CompletionRequest):
        if body.best_of is not None and body.best_of != 1:
            raise bad_request("only best_of=1 is supported", "best_of")
        if body.suffix:
            raise bad_request("suffix is not supported", "suffix")
        return
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        raise bad_request(
            f"response_format {fmt.type!r} is not supported: Baton answers in plain text "
            "(no structured output)",
            "response_format",
        )
    if body.functions:
        raise bad_request("function calling is not supported (functions)", "functions")
    if body.tools and body.tool_choice != "none":
        raise bad_request(
            'function calling is not supported: send no tools, or tool_choice "none"',
            "tools",
        )
    if not body.tools and body.tool_choice not in (None, "none", "auto"):
        # (OpenAI: a tool_choice that names or requires a tool needs tools)
        raise bad_request(
            f"tool_choice {body.tool_choice!r} needs tools, and function calling is not supported",
            "tool_choice",
        )
    for i, m in enumerate(body.messages):
        if m.tool_calls:
            raise bad_request(
                "tool calls in messages are not supported (function calling is not)",
                f"messages[{i}].tool_calls",
            )
    if body.modalities is not None and set(body.modalities) - {"text"}:
        raise bad_request("only the text modality is supported", "modalities")
    if body.audio is not None:
        raise bad_request("audio output is not supported", "audio")
    if body.web_search_options is not None:
        raise bad_request("web search is not supported", "web_search_options")
    if body.prediction is not None:
        raise bad_request("predicted outputs are not supported", "prediction")
    if body.reasoning_effort not in (None, "none"):
        raise bad_request(
            "reasoning_effort is not supported: these models do not reason before answering",
            "reasoning_effort",
        )


def message_text(i: int, message: ChatMessage) -> str:
    """The text of `messages[i]`; a 400 naming the field for content OpenAI refuses: none
    outside an assistant turn, an empty list of parts, a text part without its text, a
    part that is not text (Baton serves text only)."""
    at = f"messages[{i}].content"
    content = message.content
    if content is None:
        if message.role == "assistant":  # (a turn that called tools has no content)
            return ""
        raise bad_request(f"{at} is required in a {message.role!r} message", at)
    if isinstance(content, str):
        return content
    if not content:
        raise bad_request(f"{at} must not be an empty list", at)
    parts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise bad_request(
                f"content parts of type {part.type!r} are not supported (text only)",
                f"{at}[{j}].type",
            )
        if part.text is None:
            raise bad_request(f"{at}[{j}].text is required in a text part", f"{at}[{j}].text")
        parts.append(part.text)
    return "".join(parts)


def logprobs_k(body: ChatCompletionRequest | CompletionRequest) -> int | None:
    """How many top logprobs per token (None = no logprobs); 400 naming the field if out of range.

    Chat: `logprobs: true` turns them on, `top_logprobs` (0-20) asks for the top k.
    Completions (legacy): `logprobs` is the k itself (OpenAI caps it at 5; the engine serves 20).
    """
    name = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
    k = body.top_logprobs if isinstance(body, ChatCompletionRequest) else body.logprobs
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise bad_request(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {k}", name)
    if not isinstance(body, ChatCompletionRequest):
        return k
    if not body.logprobs:
        if k:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return k or 0


def sampling_params(
    body: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    defaults: tuple[float, float],
) -> SamplingParams:
    """The request's sampling; `defaults` (temperature, top_p) fill what it leaves out
    (ClusterConfig.sampling_defaults)."""
    logprobs = logprobs_k(body)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=defaults[0] if body.temperature is None else body.temperature,
        top_p=defaults[1] if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        seed=body.seed,
        frequency_penalty=body.frequency_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        stop=body.stop_list,
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
    )
