"""One completion request, from HTTP body to the last SSE chunk.

    parse -> tokenize -> check limits -> admit -> route -> submit
          -> stream: SSE headers at once, then the chunks from the first event on
          -> or first event -> collect (one JSON body)

The input side (parse, check, tokenize) is `preparation.prepare`; the output side
(events to SSE or JSON) is `generation.Generation`. A stream's headers (200) go out as soon as the
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
import time
from collections.abc import Mapping

from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive

from services.gateway.dispatch import send_routed
from services.gateway.errors import GatewayError
from services.gateway.generation import ClientDisconnected, Generation, failure
from services.gateway.preparation import prepare
from services.gateway.prepared import Prepared
from services.gateway.service import GatewayService
from services.gateway.sse import SSEResponse
from shared.chat_template import LONG_TEXT_CHARS
from shared.messages.gateway import RequestFailed

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
