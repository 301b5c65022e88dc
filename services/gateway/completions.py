"""One completion request, from HTTP body to the last SSE chunk.

    parse -> tokenize -> check limits -> admit -> route -> submit
          -> stream: SSE headers at once, then the chunks from the first event on
          -> or first event -> collect (one JSON body)

The output side (events to SSE or JSON) is `generation.Generation`.
Everything that can be checked before routing is checked here, so bad input gets a
4xx status without touching a worker. A stream's headers (200) go out as soon as the
request is submitted, as vLLM's and OpenAI's do: the client takes them in while the
worker runs the prefill, which keeps ~0.3 ms off the TTFT (perf_counter stamps in the
gateway and the worker against the client's, random-tiny). What fails after that is reported in-band, as an error chunk. A
non-stream request still waits for the first event, and so answers a worker's refusal
with its status. A 503 before the first token (the worker was draining, or it or its
link went away) is not the client's to see: the request goes to another instance
(`Generation.first_event`).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Mapping
from typing import Any

import msgspec
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive

from services.gateway.dispatch import send_routed
from services.gateway.errors import GatewayError
from services.gateway.generation import ClientDisconnected, Generation, failure
from services.gateway.prepared import Prepared
from services.gateway.protocol import (
    CHAT_DECODER,
    COMPLETION_DECODER,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from services.gateway.service import GatewayService
from services.gateway.sse import SSEResponse
from shared.chat_template import LONG_TEXT_CHARS, SpecialTextInContent
from shared.config import IMPLEMENTED_POLICIES
from shared.messages.gateway import RequestFailed
from shared.sampling import MAX_TOP_LOGPROBS, InvalidParam, SamplingParams


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


def routing_headers(headers: Mapping[str, str]) -> tuple[float | None, str | None, str | None]:
    """(TTFT target ms, task, policy) from the request headers; 400 when malformed."""
    ttft: float | None = None
    raw = headers.get(SLO_TTFT_HEADER)
    if raw is not None:
        try:
            ttft = float(raw)
        except ValueError:
            ttft = -1.0
        if not (0 < ttft < float("inf")):
            raise bad_request(
                f"header {SLO_TTFT_HEADER} must be a positive number of milliseconds, got {raw!r}",
                SLO_TTFT_HEADER,
            )
    task = headers.get(TASK_HEADER) or None
    policy = headers.get(POLICY_HEADER) or None
    if policy is not None and policy not in IMPLEMENTED_POLICIES:
        raise bad_request(
            f"header {POLICY_HEADER} must be one of {', '.join(IMPLEMENTED_POLICIES)}, "
            f"got {policy!r}",
            POLICY_HEADER,
        )
    return ttft, task, policy


def prepare(
    service: GatewayService,
    raw: bytes,
    is_chat: bool,
    request_id: str,
    headers: Mapping[str, str] | None = None,
) -> Prepared:
    """Parse and validate; raises GatewayError (4xx/503) with a user-facing message.
    `request_id`: the id asgi.CompletionRoutes minted for it."""
    ttft_target_ms, task, policy = routing_headers(headers or {})
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
        return _prepare_decoded(service, body, is_chat, request_id, ttft_target_ms, task, policy)
    except GatewayError as exc:
        if service.cluster.candidates(body.model):  # a name it serves: a bounded label
            exc.model = body.model
        raise


def _prepare_decoded(
    service: GatewayService,
    body: ChatCompletionRequest | CompletionRequest,
    is_chat: bool,
    request_id: str,
    ttft_target_ms: float | None,
    task: str | None,
    policy: str | None,
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
    params = _sampling_params(body, requested, service.sampling_defaults[body.model])
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
    return Prepared(
        request_id,
        is_chat,
        body,
        prompt_ids,
        params,
        tokenizer,
        ttft_target_ms=ttft_target_ms,
        task=task,
        policy=policy,
    )


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


def _logprobs_k(body: ChatCompletionRequest | CompletionRequest) -> int | None:
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


def _sampling_params(
    body: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    defaults: tuple[float, float],
) -> SamplingParams:
    """The request's sampling; `defaults` (temperature, top_p) fill what it leaves out
    (ClusterConfig.sampling_defaults)."""
    logprobs = _logprobs_k(body)
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


# Bodies up to this are prepared on the event loop (~0.2 ms for a short chat); larger
# ones in a thread, where their long texts' tokenizing releases the GIL (encode_ids
# takes encode_batch past LONG_TEXT_CHARS characters: no body under this holds one).
PREPARE_INLINE_BYTES = LONG_TEXT_CHARS


async def watch_disconnect(receive: Receive, run: Generation) -> None:
    """Wait for the client's http.disconnect (the body is read already, so `receive` has
    nothing else to give) and wake the handler waiting on the request's stream."""
    while (await receive())["type"] != "http.disconnect":
        pass
    run.client_left()


async def handle(
    service: GatewayService,
    raw: bytes,
    is_chat: bool,
    request_id: str,
    headers: Mapping[str, str] | None = None,
    receive: Receive | None = None,
) -> ASGIApp:
    """The whole request; GatewayError propagates to the caller (asgi.CompletionRoutes).

    `receive` (the ASGI channel) is watched while the handler waits for the worker and,
    for a stream, while the SSEResponse runs: a client that disconnects gets its request
    aborted on the worker, streaming or not."""
    t_prepare = time.perf_counter()
    if len(raw) <= PREPARE_INLINE_BYTES:
        p = prepare(service, raw, is_chat, request_id, headers)
    else:  # a long prompt's tokenizing must not hold the loop every stream runs on
        p = await asyncio.to_thread(prepare, service, raw, is_chat, request_id, headers)
    prepare_ms = (p.t0 - t_prepare) * 1000.0
    # Sent with the answer, and with an error once the request was sent (X-Request-Id:
    # the id to find it by in the logs, which asgi.CompletionRoutes puts on every error;
    # X-Instance-Id: where it went first (the `baton` object names the instance that
    # answered; they differ only after a reroute).
    ids = {"X-Request-Id": p.request_id}
    try:
        return await _respond(service, p, prepare_ms, receive, ids)
    except GatewayError as exc:
        exc.headers.update(ids)
        exc.model = exc.model or p.body.model  # (not routed yet: the name asked for)
        raise


async def _respond(
    service: GatewayService,
    p: Prepared,
    prepare_ms: float,
    receive: Receive | None,
    ids: dict[str, str],
) -> ASGIApp:
    """Admit, route and answer a prepared request (`handle`); `ids` gets X-Instance-Id
    once the request is sent."""
    service.admit()
    try:
        reply, stream, baton = await send_routed(service, p)
    except BaseException:
        service.release()
        raise
    ids["X-Instance-Id"] = stream.instance_id
    run = Generation(service, p, stream, reply.model or p.body.model)
    run.baton = {**run.baton, **baton, "prepare_ms": round(prepare_ms, 3)}
    watcher = None if receive is None else asyncio.create_task(watch_disconnect(receive, run))
    headers = dict(ids)
    if p.body.stream:  # the response owns the watcher: it watches the client while streaming
        return SSEResponse(run.sse(), headers, watcher, run.close)
    try:
        first = await run.first_event()
        if isinstance(first, RequestFailed):
            run.is_engine_done = True
            raise failure(first)
        return JSONResponse(await run.collect(first), headers=headers)
    except ClientDisconnected:  # counted by close(): a 499
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    except GatewayError as exc:  # answered and counted by asgi.error_response
        exc.model = run.model  # (the model that answered, as its 200s are counted)
        run.is_reported = True
        raise
    except Exception:  # a bug: asgi answers and counts a 500
        run.is_reported = True
        raise
    finally:
        run.close()  # aborts on the worker unless the answer is complete
        if watcher is not None:
            watcher.cancel()
