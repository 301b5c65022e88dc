"""A completion request's body made into a `Prepared`: parsed, checked against the
cluster and the model's context, tokenized. Everything that can be checked before
routing is checked here, so bad input gets a 4xx without touching a worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from services.gateway.errors import GatewayError
from services.gateway.prepared import Prepared
from services.gateway.protocol import (
    CHAT_DECODER,
    COMPLETION_DECODER,
    ChatCompletionRequest,
    CompletionRequest,
)
from services.gateway.request_checks import (
    RoutingHeaders,
    bad_request,
    message_text,
    refuse_unsupported,
    routing_headers,
    sampling_params,
    validation_param,
)
from services.gateway.service import GatewayService
from shared.chat_template import SpecialTextInContent
from shared.sampling import InvalidParam


def prepare(
    service: GatewayService,
    raw: bytes,
    is_chat: bool,
    request_id: str,
    headers: Mapping[str, str] | None = None,
) -> Prepared:
    """Parse and validate; raises GatewayError (4xx/503) with a user-facing message.
    `request_id`: the id asgi.CompletionRoutes minted for it."""
    routing = routing_headers(headers or {})
    try:
        body: ChatCompletionRequest | CompletionRequest = (
            CHAT_DECODER if is_chat else COMPLETION_DECODER
        ).decode(raw)
    except msgspec.ValidationError as exc:
        raise bad_request(f"invalid request: {exc}", validation_param(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # msgspec's depth guard: no request nests this deep
        raise bad_request("the body's JSON nests too deeply", code="invalid_json") from None
    try:
        return _prepare_decoded(service, body, is_chat, request_id, routing)
    except GatewayError as exc:
        if service.cluster.candidates(body.model):  # a name it serves: a bounded label
            exc.model = body.model
        raise


def _prepare_decoded(
    service: GatewayService,
    body: ChatCompletionRequest | CompletionRequest,
    is_chat: bool,
    request_id: str,
    routing: RoutingHeaders,
) -> Prepared:
    """`prepare` past decoding: the checks of the request's fields."""
    if body.n not in (1, None):
        raise bad_request("only n=1 is supported", "n")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    refuse_unsupported(body)
    if not service.cluster.candidates(body.model):
        known = sorted([*service.cluster.models, *service.cluster.presets])
        raise GatewayError(
            404,
            f"the model {body.model!r} does not exist; available: {', '.join(known)}",
            "invalid_request_error",
            "model_not_found",
            "model",
        )
    tokenizer = service.tokenizer(body.model)
    prompt_ids = _tokenize(body, tokenizer, service.max_prompt_chars(body.model))
    if not prompt_ids:
        raise bad_request("the prompt is empty", "prompt")

    serving = service.directory.serving(body.model)
    if not serving:
        raise GatewayError(
            503,
            f"no live worker serves model {body.model!r}; retry later",
            "service_unavailable",
            "no_worker",
            retry_after_s=service.settings.retry_after_s,
        )
    max_model_len = min(w.max_model_len for w in serving)
    requested = (
        body.max_completion_tokens
        if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None
        else body.max_tokens
    )
    if requested is None:
        room = max_model_len - len(prompt_ids)
        if room < 1:  # (not "max_tokens must be >= 1, got -983": the client sent none)
            raise bad_request(
                f"this model's maximum context length is {max_model_len} tokens and the "
                f"prompt has {len(prompt_ids)}: no room for a completion. Shorten the prompt.",
                "messages" if is_chat else "prompt",
                "context_length_exceeded",
            )
        requested = room if is_chat else min(service.settings.default_completion_max_tokens, room)
    params = sampling_params(body, requested, service.sampling_defaults[body.model])
    preset = service.cluster.presets.get(body.model)
    if preset is not None and preset.is_token_level and params.logprobs is not None:
        # a peer's tokens come back without their logprobs (the worker refuses it too)
        raise bad_request(
            f"logprobs are not available for the token-level preset {body.model!r}",
            "logprobs",
        )
    if params.stop_token_ids and not _ids_in_vocab(params.stop_token_ids, tokenizer):
        raise bad_request(
            f"stop_token_ids must be in [0, {tokenizer.vocab_size})", "stop_token_ids"
        )
    try:
        params.validate()
    except InvalidParam as exc:
        field, message = exc.param, str(exc)
        if field == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
            field = "max_completion_tokens"  # the field the client sent
            message = message.replace("max_tokens", field, 1)
        raise bad_request(message, field) from None
    if len(prompt_ids) + params.max_tokens > max_model_len:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens; you requested "
            f"{len(prompt_ids) + params.max_tokens} tokens ({len(prompt_ids)} in the prompt, "
            f"{params.max_tokens} for the completion). Shorten the prompt or lower max_tokens.",
            # the field to change: the prompt when it alone leaves no room
            ("messages" if is_chat else "prompt")
            if len(prompt_ids) >= max_model_len
            else "max_tokens",
            "context_length_exceeded",
        )
    if routing.budget is not None:
        _check_budget(service, body.model, len(prompt_ids), routing.budget)
    return Prepared(
        request_id,
        is_chat,
        body,
        prompt_ids,
        params,
        tokenizer,
        ttft_target_ms=routing.ttft_target_ms,
        task=routing.task,
        policy=routing.policy,
        weights=routing.weights,
        budget=routing.budget,
    )


def _check_budget(
    service: GatewayService, model: str, num_prompt_tokens: int, budget: float
) -> None:
    """A 400 when no candidate model can write one token within the budget (the prompt
    alone may cost more than it)."""
    models = service.cluster.models
    cheapest = min(models[m].cost(num_prompt_tokens, 1) for m in service.cluster.candidates(model))
    if cheapest > budget:
        raise bad_request(
            f"a budget of {budget:g} does not pay for this prompt and one token on any of "
            f"{model!r}'s models (at least {cheapest:.6g})",
            "x-baton-budget",
            "budget_too_small",
        )


def _ids_in_vocab(ids: list[int], tokenizer: Any) -> bool:
    vocab = tokenizer.vocab_size
    return all(0 <= t < vocab for t in ids)


def _too_long(num_chars: int, max_chars: int, param: str) -> GatewayError:
    return bad_request(
        f"the prompt has {num_chars} characters: more than this model's context can hold "
        f"(at most {max_chars}: twice its maximum context length times the longest token). "
        "Shorten the prompt.",
        param,
        "context_length_exceeded",
    )


def _tokenize(
    body: ChatCompletionRequest | CompletionRequest, tokenizer: Any, max_chars: int
) -> list[int]:
    """The prompt's ids. A prompt of more than `max_chars` characters cannot fit the
    context whatever its tokens: refused before it is tokenized (which took ~0.5 s a
    MB here: GatewayService.max_prompt_chars)."""
    if isinstance(body, ChatCompletionRequest):
        if not body.messages:
            raise bad_request("messages must not be empty", "messages")
        # OpenAI's newer name for the system role (chat templates know "system" only)
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": message_text(i, m)}
            for i, m in enumerate(body.messages)
        ]
        num_chars = sum(len(m["content"]) for m in messages)
        if num_chars > max_chars:
            raise _too_long(num_chars, max_chars, "messages")
        try:
            return list(tokenizer.apply_chat_template(messages))
        except SpecialTextInContent as exc:
            raise bad_request(str(exc), f"messages[{exc.index}].content") from None
    if body.echo:
        raise bad_request("echo is not supported", "echo")
    prompt: str | list[str | int | list[int]] | list[int] = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of one prompt: that prompt
    if isinstance(prompt, str):
        if len(prompt) > max_chars:
            raise _too_long(len(prompt), max_chars, "prompt")
        return list(tokenizer.encode(prompt))
    ids = [p for p in prompt if isinstance(p, int)]
    if ids and len(ids) == len(prompt):
        # checked here, not only by the worker: a stream's status is sent before it answers
        if not _ids_in_vocab(ids, tokenizer):
            raise bad_request(f"prompt token ids must be in [0, {tokenizer.vocab_size})", "prompt")
        return ids
    raise bad_request(
        "prompt must be a string, a list of token ids, or a list with exactly one string or "
        "one list of token ids (n=1: one prompt)",
        "prompt",
    )
