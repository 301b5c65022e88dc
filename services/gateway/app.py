"""The gateway's HTTP surface: FastAPI (models, health, metrics, OpenAI-format errors,
lifespan), whose own `__call__` hands the completion routes to `asgi.CompletionRoutes`
before its machinery runs (asgi.py says why)."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from services.gateway.asgi import CompletionRoutes, authorize, error_response
from services.gateway.config import GatewayServiceConfig
from services.gateway.errors import GatewayError
from services.gateway.protocol import error_body
from services.gateway.service import GatewayService
from shared.runtime import freeze_heap


def forwarded_allow_ips() -> str:
    """The proxies whose X-Forwarded-For/-Proto are believed: uvicorn's default."""
    return os.environ.get("FORWARDED_ALLOW_IPS", "127.0.0.1")


class GatewayApp(FastAPI):
    """FastAPI, with the completion routes served ahead of it (`completions`, set by
    create_app): ahead of its middleware too, so of uvicorn's proxy-headers middleware,
    which create_app adds to FastAPI's stack instead of uvicorn wrapping every request
    in it (server_config turns uvicorn's off). FastAPI's routes use what a reverse proxy
    forwards (their redirects use the scheme); the completion routes read neither, and
    the middleware would cost them ~43 us of a request on cold caches (67 against 24 us,
    a probe sweeping 16 MB between calls)."""

    completions: CompletionRoutes
    # Starlette's CORS middleware around `dispatch` when [gateway] cors_allow_origins is
    # set: outermost, so that the completion routes have it too
    cors: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.cors is None:
            await self.dispatch(scope, receive, send)
        else:
            await self.cors(scope, receive, send)

    async def dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        is_chat = CompletionRoutes.match(scope)
        if is_chat is None:
            await super().__call__(scope, receive, send)
        else:
            await self.completions.serve(scope, receive, send, is_chat)


def create_app(cfg: GatewayServiceConfig, freeze_heap_when_started: bool = False) -> GatewayApp:
    """The app; `freeze_heap_when_started` (the gateway's own process only:
    shared.runtime.freeze_heap says why) freezes the heap once the service started."""
    service = GatewayService(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        if freeze_heap_when_started:
            freeze_heap()
        try:
            yield
        finally:
            await service.close()

    app = GatewayApp(title="Baton", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(ProxyHeadersMiddleware, trusted_hosts=forwarded_allow_ips())
    if cfg.settings.cors_allow_origins:
        # As vLLM's: any method and header; no cookies (the API takes bearer keys). The
        # request and instance ids are exposed to the page.
        app.cors = CORSMiddleware(
            app.dispatch,
            allow_origins=cfg.settings.cors_allow_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id", "X-Instance-Id", "Retry-After"],
        )
    app.state.service = service

    @app.exception_handler(GatewayError)
    async def on_gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return error_response(service, exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":  # no such route: as OpenAI says
            message = f"Invalid URL ({request.method} {request.url.path})"
        # (a 405's headers name the methods allowed: HTTP requires Allow there)
        return JSONResponse(
            error_body(message, type_), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(str(exc.errors()), "invalid_request_error"), status_code=400)

    api_keys = [k.encode() for k in cfg.settings.api_keys]
    # The completion routes run ahead of FastAPI's machinery (services/gateway/asgi.py says why).
    app.completions = CompletionRoutes(service, api_keys)

    started_s = time.time()  # (the app is made when the gateway starts)

    def model_cards() -> list[dict[str, object]]:
        """OpenAI's model objects: the real models, then the routing presets. `created`:
        when the model's longest-running live worker started (a preset: the earliest
        of its models'), else when this gateway started; stable from call to call."""
        live = {w.model for w in service.workers.values() if not w.is_draining}
        since: dict[str, float] = {}  # model -> its longest-running live worker's start
        for w in service.workers.values():
            if not w.is_draining:
                since[w.model] = min(since.get(w.model, w.started_at_s), w.started_at_s)

        def created(*models: str) -> int:
            return int(min((since[m] for m in models if m in since), default=started_s))

        data: list[dict[str, object]] = [
            {
                "id": name,
                "object": "model",
                "created": created(name),
                "owned_by": "baton",
                "is_live": name in live,
                "max_model_len": max(
                    (w.max_model_len for w in service.workers.values() if w.model == name),
                    default=None,
                ),
            }
            for name in cfg.cluster.models
        ]
        data += [
            {
                "id": name,
                "object": "model",
                "created": created(*p.models),
                "owned_by": "baton-router",
                "is_preset": True,
                "models": list(p.models),
                "policy": p.policy,  # which instance of the entry model takes a request
                # per token: the policy passing the pen between `models` (None: whole answers)
                "token_policy": p.token_policy,
                "description": p.description,
            }
            for name, p in cfg.cluster.presets.items()
        ]
        return data

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, object]:
        authorize(request.headers, api_keys)
        return {"object": "list", "data": model_cards()}

    @app.get("/v1/models/{model_id}")
    async def retrieve_model(model_id: str, request: Request) -> dict[str, object]:
        authorize(request.headers, api_keys)
        for card in model_cards():
            if card["id"] == model_id:
                return card
        raise GatewayError(
            404,
            f"the model {model_id!r} does not exist",
            "invalid_request_error",
            "model_not_found",
            "model",
        )

    # (HEAD too, for load balancers and uptime checks: the same answer without its body)
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        routable = service.directory.routable()
        # Live instances per model of the cluster file: "degraded" (still 200: the
        # others serve) names what a model with none would answer with 503s.
        models = {name: 0 for name in cfg.cluster.models}
        for w in routable:
            models[w.model] = models.get(w.model, 0) + 1
        bus = "down"
        if service.bus.is_connected:
            bus = "ok" if service.is_bus_responsive else "unresponsive"
        relay = service.relay_state
        status = "unavailable"
        if service.is_ready:
            healthy = all(models.values()) and bus == "ok" and relay in (None, "ok", "unknown")
            status = "ok" if healthy else "degraded"
        body = {
            "status": status,
            "gateway_id": cfg.gateway_id,
            # NATS: "unresponsive" when connected but its pings go unanswered (routing
            # and token routing stall; plain requests go on over direct links)
            "bus": bus,
            # the token-routing relay (only where a preset routes per token): "ok",
            # "unresponsive" (routed requests stall), "down" (restarting), "unknown"
            **({"relay": relay} if relay is not None else {}),
            "workers": [w.instance_id for w in routable],
            "models": models,
            "in_flight": service.num_in_flight,
        }
        return JSONResponse(body, status_code=200 if service.is_ready else 503)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics() -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
