"""The output side of one admitted request: worker events in, SSE chunks or one JSON body out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

from services.gateway.dispatch import send_routed
from services.gateway.errors import GatewayError
from services.gateway.logprobs import logprobs_object
from services.gateway.protocol import SSE_DONE, choice_object, error_body, sse, usage
from services.gateway.service import GatewayService
from services.gateway.streams import (
    CLIENT_GONE,
    ClientGone,
    RequestStream,
    StreamEvent,
    WorkerSilent,
)
from services.gateway.text import LogprobSlice, TextStream
from shared.logging import get_logger
from shared.messages.gateway import GatewayEvent, RequestFailed, TokenDelta

if TYPE_CHECKING:
    from services.gateway.prepared import Prepared

log = get_logger(component="gateway")

# Times a request the worker refused or lost as unavailable (503) before its first token
# is sent to another instance (Generation.first_event).
MAX_REROUTES = 2

# What one delta adds: (new text, new token ids, the logprobs it releases: TextStream;
# None when the request asked for none)
Piece = tuple[str, list[int], LogprobSlice | None]


class ClientDisconnected(Exception):
    """The HTTP client went away before the answer was complete."""


def silence() -> GatewayError:
    return GatewayError(504, "the worker did not answer in time", "timeout", "worker_timeout")


def failure(event: RequestFailed) -> GatewayError:
    if event.status < 500:
        kind = "invalid_request_error"
    elif event.status == 500:
        kind = "server_error"  # the worker's model failed on the request's batch
    else:
        kind = "service_unavailable"
    return GatewayError(event.status, event.message, kind)


class Generation:
    """The output side of one admitted request: events in, text pieces and usage out."""

    def __init__(
        self, service: GatewayService, p: Prepared, stream: RequestStream, model: str
    ) -> None:
        self.service = service
        self.p = p
        self.stream = stream
        self.model = model
        self.tried: set[str] = {stream.instance_id}  # instances it was sent to
        self.is_client_gone = False  # the HTTP client disconnected (client_left)
        self.created = int(p.arrival_time_s)
        eos = getattr(p.tokenizer, "eos_token_id", None)
        skip = set() if eos is None or p.params.ignore_eos else {eos}
        if not p.body.include_stop_str_in_output:  # (as vLLM: the stop token's text is not
            skip.update(p.params.stop_token_ids)  # the answer's; it can only be the last)
        self.text = TextStream(
            p.tokenizer,
            p.params.stop,
            skip,
            keep_special=not p.body.skip_special_tokens,
            include_stop=p.body.include_stop_str_in_output,
        )
        self.num_prompt_tokens = len(p.prompt_token_ids)
        self._wants_logprobs = p.params.logprobs is not None
        self.tokens_by_model: dict[str, int] | None = None  # token-level presets, at the end
        self.finish_reason: str | None = None
        self.is_finished = False  # the answer is complete (the client got or gets all of it)
        self.is_engine_done = False  # the worker sends nothing more: no abort needed
        self.is_reported = False  # its status is counted (here, or by the error answer)
        self._closed = False
        self._last_token_t: float | None = None
        # Routing facts for the response's `baton` object (model, instance, policy,
        # prepare_ms, router_overhead_ms, predicted_ttft_ms); `cost` and
        # `first_token_ms` are added at the end.
        self.baton: dict[str, Any] = {"model": model}
        preset = service.cluster.presets.get(p.body.model)
        if preset is not None:  # which preset routed it; a token-level one: its policy
            self.baton["preset"] = p.body.model
            if preset.token_policy is not None:
                self.baton["token_policy"] = preset.token_policy
        self._label(model)
        service.metrics.queued.inc()

    def _label(self, model: str) -> None:
        # this request's series, looked up once: labels() per token was ~4% of the
        # gateway's CPU while streaming
        m = self.service.metrics
        self._itl_s = m.itl_s.labels(model)
        self._output_tokens = m.output_tokens.labels(model)

    def restart(self, stream: RequestStream, model: str, baton: dict[str, Any]) -> None:
        """The request was sent again, to `stream`'s instance (before any token of the
        first: nothing of the answer is lost or repeated)."""
        self.stream = stream
        self.tried.add(stream.instance_id)
        if self.is_client_gone:  # it left while the request was being sent again
            stream.events.put_nowait(CLIENT_GONE)
        if model != self.model:
            self.model = model
            self._label(model)
        self.baton.update(baton)

    def client_left(self) -> None:
        """The HTTP client disconnected: wake whoever waits on the request's stream (a
        reroute passes it on to the next one)."""
        self.is_client_gone = True
        self.stream.events.put_nowait(CLIENT_GONE)

    async def next_event(self) -> GatewayEvent:
        """The worker's next event; ClientDisconnected if the client left first, a 504
        GatewayError if the worker fell silent for `event_timeout_s` (the service's
        silence watch queues that)."""
        return self._checked(await self.stream.events.get())

    async def first_event(self) -> GatewayEvent:
        """The first event of the answer. A 503 before it (the worker was draining, or
        it or its link went away: it holds nothing of the request) sends the request to
        another instance, up to MAX_REROUTES times, unseen by the client; when no other
        instance serves the model, the 503 stands."""
        event = await self.next_event()
        for _ in range(MAX_REROUTES):
            if not (isinstance(event, RequestFailed) and event.status == 503):
                break
            if not await self._reroute():
                break
            event = await self.next_event()
        return event

    async def _reroute(self) -> bool:
        """Close the request on the instance that refused or lost it (it holds nothing
        of it) and send it, under the same id, to one it has not tried; False when there
        is none (or routing fails)."""
        failed = self.stream.instance_id
        self.service.finish(self.stream, aborted=False)
        try:
            reply, stream, baton = await send_routed(self.service, self.p, frozenset(self.tried))
        except GatewayError:
            return False
        self.restart(stream, reply.model or self.p.body.model, baton)
        self.service.metrics.reroutes.inc()
        log.info(
            "request_rerouted", request_id=self.p.request_id, failed=failed, to=stream.instance_id
        )
        return True

    def _checked(self, event: StreamEvent) -> GatewayEvent:
        """The worker's event itself, or the exception a sentinel stands for."""
        if isinstance(event, ClientGone):
            raise ClientDisconnected
        if isinstance(event, WorkerSilent):
            raise silence()
        return event

    async def pieces(self, first: GatewayEvent) -> AsyncIterator[Piece]:
        """(new text, new token ids, their logprobs, their top logprobs) per piece, until
        the request finishes.

        A piece is one delta, or several: deltas already queued behind the one just
        taken are merged into it (the handler fell behind the worker: one SSE chunk, one
        client wake-up for all of them, as vLLM's output collector merges outputs its
        consumer has not taken yet). Nothing waits for more; the first token goes out
        the moment it arrives.
        """
        held: StreamEvent | None = first  # taken from the queue, not yet handled
        while True:
            event = self._checked(held) if held is not None else await self.next_event()
            held = None
            if isinstance(event, RequestFailed):
                self.is_engine_done = True
                raise failure(event)
            assert isinstance(event, TokenDelta)
            text, ids, lps = self._take(event)
            # Merge what is already queued, up to the end of the answer or a failure
            # (the next round reports it, after this text); a gone client ends it here.
            queue = self.stream.events
            while self.finish_reason is None and not queue.empty():
                nxt = queue.get_nowait()
                if isinstance(nxt, ClientGone):
                    raise ClientDisconnected
                if not isinstance(nxt, TokenDelta):
                    held = nxt
                    break
                more_text, more_ids, more_lps = self._take(nxt)
                text += more_text
                ids += more_ids
                if lps is not None and more_lps is not None:
                    lps.extend(more_lps)
            self._observe(len(ids))
            if self.finish_reason is not None:
                self.is_finished = True
                text += self.text.finish()
                if lps is not None:
                    lps.extend(self.text.take_logprobs(final=True))
                yield text, ids, lps
                return
            yield text, ids, lps

    def _take(self, event: TokenDelta) -> Piece:
        """One delta into the text stream; sets the finish reason when it ends the answer."""
        self.num_prompt_tokens = event.num_prompt_tokens
        if event.tokens_by_model is not None:
            self.tokens_by_model = event.tokens_by_model
        text, ids = self.text.add(
            event.position, event.token_ids, event.logprobs, event.top_logprobs
        )
        lps = self.text.take_logprobs() if self._wants_logprobs else None
        if event.finish_reason is not None and not self.text.assembler.has_gap:
            self.finish_reason = event.finish_reason
        elif self.text.is_stopped:
            self.finish_reason = "stop"  # the gateway saw the stop string first: cut here
        if self.finish_reason is not None:
            self.is_engine_done = event.finish_reason is not None
        return text, ids, lps

    def _observe(self, num_new: int) -> None:
        if num_new == 0:
            return
        now = time.perf_counter()
        if self._last_token_t is None:
            self.stream.first_token_at = now
            # Counted in the next loop pass, once the first chunk is written: the
            # metrics' locks and lookups were ~0.04 ms of the first token's path after an
            # idle gap (perf_counter stamps in the gateway).
            asyncio.get_running_loop().call_soon(self._count_first_token, now)
        else:
            self._itl_s.observe(now - self._last_token_t)
        self._last_token_t = now
        self._output_tokens.inc(num_new)

    def _count_first_token(self, at: float) -> None:
        m = self.service.metrics
        m.ttft_s.labels(self.model).observe(at - self.p.t0)
        m.queued.dec()

    @property
    def num_output_tokens(self) -> int:
        return len(self.text.assembler.token_ids)

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage object; token-level presets add the tokens each model wrote."""
        out = usage(self.num_prompt_tokens, self.num_output_tokens)
        if self.tokens_by_model is not None:
            out["tokens_by_model"] = dict(self.tokens_by_model)
        return out

    def baton_summary(self) -> dict[str, Any]:
        """The `baton` object: routing facts plus the request's cost at the models' prices
        (per model that wrote tokens, for token-level presets)."""
        models = self.service.cluster.models
        cost = None
        if self.tokens_by_model is not None:
            entry = models.get(self.baton.get("model") or self.model)
            cost = (entry.cost(self.num_prompt_tokens, 0) if entry is not None else 0.0) + sum(
                models[m].cost(0, n) for m, n in self.tokens_by_model.items() if m in models
            )
        else:
            served = models.get(self.baton.get("model") or self.model)
            if served is not None:
                cost = served.cost(self.num_prompt_tokens, self.num_output_tokens)
        ttft_ms = self.stream.ttft_ms()  # submit -> first token here
        first_token_ms = None if ttft_ms is None else round(ttft_ms, 3)
        if cost is not None:  # (a sum of per-model costs: no float noise in the digits)
            cost = float(f"{cost:.10g}")
        out = {**self.baton, "first_token_ms": first_token_ms, "cost": cost}
        if "budget" in out:  # whether the budget's cap ended the answer
            out["budget_stopped"] = out["budget_max_tokens"] is not None and (
                self.finish_reason == "length"
            )
        return out

    async def collect(self, first: GatewayEvent) -> dict:
        parts: list[str] = []
        all_lps = LogprobSlice() if self._wants_logprobs else None
        async for text, _, lps in self.pieces(first):
            parts.append(text)
            if all_lps is not None and lps is not None:
                all_lps.extend(lps)
        text = "".join(parts)
        logprobs = logprobs_object(self.p.is_chat, self.p.params.logprobs, all_lps, self.text)
        content = {"message": {"role": "assistant", "content": text}} if self.p.is_chat else {}
        choice = choice_object(self.p.is_chat, text, logprobs, self.finish_reason, content)
        obj = "chat.completion" if self.p.is_chat else "text_completion"
        return {
            "id": self.p.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(),
            "baton": self.baton_summary(),
        }

    async def sse(self) -> AsyncGenerator[bytes, None]:
        """The stream's chunks. Its headers went out before the first token (see
        completions.handle), so what is built here before waiting for it (the chat role
        chunk) is off the TTFT path."""
        include_usage = self.p.body.include_usage
        obj = "chat.completion.chunk" if self.p.is_chat else "text_completion"
        head = {
            "id": self.p.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
        }
        extra = {"usage": None} if include_usage else {}
        # Chunks are coalesced into one write where they are ready together: the chat
        # role chunk goes out with the first token's, the usage chunk and [DONE] with
        # the last one's (each write is a wake-up of the client; the first one is TTFT).
        pending = b""
        try:
            if self.p.is_chat:
                pending = sse(
                    {
                        **head,
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                        **extra,
                    }
                )
            first = await self.first_event()
            async for text, _, lps in self.pieces(first):
                lp = (
                    logprobs_object(self.p.is_chat, self.p.params.logprobs, lps, self.text)
                    if lps is not None and lps.ids
                    else None
                )
                if not text and lp is None and self.finish_reason is None:
                    # Nothing to show yet (tokens held back as a possible stop string's
                    # start, a character's first bytes): no empty chunk, as OpenAI's.
                    continue
                delta = {"delta": {"content": text} if text else {}} if self.p.is_chat else {}
                choice = choice_object(self.p.is_chat, text, lp, self.finish_reason, delta)
                # Without a usage chunk, the finishing chunk carries the `baton` object.
                tail = (
                    {"baton": self.baton_summary()}
                    if self.is_finished and not include_usage
                    else {}
                )
                chunk = pending + sse({**head, "choices": [choice], **extra, **tail})
                pending = b""
                if self.is_finished:
                    pending = chunk  # the end follows at once
                else:
                    yield chunk
            if include_usage:
                pending += sse(
                    {
                        **head,
                        "choices": [],
                        "usage": self.usage(),
                        "baton": self.baton_summary(),
                    }
                )
            yield pending + SSE_DONE
        except GatewayError as exc:  # headers are sent: report in-band, as OpenAI does
            self._count(str(exc.status))
            yield pending + sse(error_body(exc.message, exc.type, exc.code)) + SSE_DONE
        except ClientDisconnected:  # nobody to tell
            return
        except Exception:  # a bug: the SSEResponse logs it and ends the stream with an error
            self._count("500")
            raise
        finally:
            self.close()

    def _count(self, status: str) -> None:
        self.is_reported = True
        self.service.metrics.requests.labels(self.model, status).inc()

    def close(self) -> None:
        """Release admission, abort on the worker if it still runs, record metrics. Idempotent, no awaits
        (it runs in `finally` of a cancelled stream)."""
        if self._closed:
            return
        self._closed = True
        if self._last_token_t is None:
            self.service.metrics.queued.dec()
        self.service.finish(self.stream, aborted=not self.is_engine_done)
        self.service.release()
        if self.is_finished:
            self._count("200")
            self.service.metrics.e2e_s.labels(self.model).observe(time.perf_counter() - self.p.t0)
        elif not self.is_engine_done and not self.is_reported:  # the client left
            self._count("499")
        log.debug(  # (a no-op call below debug: the log level filters by method)
            "request_closed",
            request_id=self.p.request_id,
            model=self.model,
            instance_id=self.stream.instance_id,
            finish_reason=self.finish_reason,
            output_tokens=self.num_output_tokens,
        )
