"""OpenAI HTTP request bodies (msgspec, validated on decode) and response encoding.

These are the public HTTP API, not Baton wire types, so they live with the
gateway. Decoding with msgspec gives exact, user-facing type errors
("Expected `int`, got `str` - at `$.max_tokens`") for free.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False  # send a final chunk with token counts


class ContentPart(msgspec.Struct, frozen=True):
    type: str  # only "text" is served
    text: str | None = None


class ResponseFormat(msgspec.Struct, frozen=True):
    type: str  # only "text" is served (json_object / json_schema: refused, not ignored)


# OpenAI's roles ("function": the deprecated one older clients still send); others: 400
Role = Literal["system", "user", "assistant", "developer", "tool", "function"]


class ChatMessage(msgspec.Struct, frozen=True):
    role: Role
    # None only for an assistant turn (one that called tools has none): completions.
    # message_text refuses it elsewhere, as OpenAI does
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[msgspec.Raw] | None = None  # an assistant turn's calls: refused


class _CommonRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM)
    # OpenAI's spec lets a client send null for these (its SDKs' unset fields): the
    # default, as if absent
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool = False  # extension (vLLM): benchmarks pin output lengths
    # extension (vLLM): False keeps special tokens (e.g. "<|im_end|>") in the text, so a
    # client of ignore_eos can see where the answer proper ended
    skip_special_tokens: bool = True
    # extensions (vLLM): ids that end the answer besides EOS; the stop string kept at
    # the end of the text
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    user: str | None = None
    # Fields that would change what the answer is, which Baton does not implement: read
    # so that a request using them is refused with a 400 (`request_checks.refuse_unsupported`)
    # rather than answered as if they were absent.
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None  # extension (vLLM): only 0
    repetition_penalty: float | None = None  # extension (vLLM): only 1

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_CommonRequest, frozen=True, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # newer name for max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[msgspec.Raw] | None = None  # function calling: served only as tool_choice "none"
    tool_choice: str | dict[str, object] | None = None
    functions: list[msgspec.Raw] | None = None  # the legacy form of tools
    modalities: list[str] | None = None  # only ["text"]
    audio: dict[str, object] | None = None  # audio output: refused
    web_search_options: dict[str, object] | None = None  # refused
    prediction: dict[str, object] | None = None  # predicted outputs: refused
    reasoning_effort: str | None = None  # reasoning models only: refused


class CompletionRequest(_CommonRequest, frozen=True, kw_only=True):
    # a string, token ids, or a batch of one: a one-string list, a list of one id list
    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None  # OpenAI legacy: an int enables logprobs
    echo: bool | None = False
    best_of: int | None = None  # only 1 (as n)
    suffix: str | None = None  # insertion after the completion: not served


# Pre-built codecs: decoding happens once per HTTP request, encoding once per chunk.
CHAT_DECODER = msgspec.json.Decoder(ChatCompletionRequest)
COMPLETION_DECODER = msgspec.json.Decoder(CompletionRequest)
JSON = msgspec.json.Encoder()

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: object) -> bytes:
    """One server-sent event carrying `obj` as JSON, pre-encoded."""
    return b"data: " + JSON.encode(obj) + b"\n\n"


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
    }


def choice_object(
    is_chat: bool, text: str, logprobs: Any, finish_reason: str | None, chat_part: dict
) -> dict:
    """One entry of `choices`: chat carries `chat_part` (its `message`, or a chunk's
    `delta`), legacy completions the text itself."""
    head: dict[str, Any] = {"index": 0, **chat_part} if is_chat else {"index": 0, "text": text}
    return {**head, "logprobs": logprobs, "finish_reason": finish_reason}
