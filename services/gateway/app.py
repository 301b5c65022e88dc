"""The gateway's HTTP surface: FastAPI routes, OpenAI-format errors, lifespan."""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway import completions
from services.gateway.config import GatewayServiceConfig
from services.gateway.protocol import error_body
from services.gateway.service import GatewayError, GatewayService
from shared.logging import get_logger

log = get_logger(component="gateway")


def create_app(cfg: GatewayServiceConfig) -> FastAPI:
    service = GatewayService(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.close()

    app = FastAPI(title="Baton", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = service

    @app.exception_handler(GatewayError)
    async def on_gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
        service.metrics.requests.labels("", str(exc.status)).inc()
        if exc.status >= 500:
            log.warning(
                "request_failed", status=exc.status, error=exc.message, path=request.url.path
            )
        return JSONResponse(
            error_body(exc.message, exc.type, exc.code, exc.param),
            status_code=exc.status,
            headers=headers,
        )

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), type_), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(str(exc.errors()), "invalid_request_error"), status_code=400)

    api_keys = [k.encode() for k in cfg.settings.api_keys]

    def authorize(request: Request) -> None:
        """Optional API keys: OpenAI clients send `Authorization: Bearer <key>`."""
        if not api_keys:
            return
        header = request.headers.get("authorization", "")
        token = header[7:].encode() if header.lower().startswith("bearer ") else b""
        if not any(hmac.compare_digest(token, k) for k in api_keys):
            raise GatewayError(
                401, "invalid or missing API key", "invalid_request_error", "invalid_api_key"
            )

    async def complete(request: Request, *, is_chat: bool) -> Response:
        authorize(request)
        return await completions.handle(
            service,
            await request.body(),
            is_chat=is_chat,
            headers=request.headers,
            receive=request.receive,
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(request, is_chat=True)

    @app.post("/v1/completions")
    async def text_completions(request: Request) -> Response:
        return await complete(request, is_chat=False)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, object]:
        authorize(request)
        created = int(time.time())
        live = {w.model for w in service.workers.values() if not w.is_draining}
        data: list[dict[str, object]] = [
            {
                "id": name,
                "object": "model",
                "created": created,
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
                "created": created,
                "owned_by": "baton-router",
                "is_preset": True,
                "models": list(p.models),
                "policy": p.policy,
                "description": p.description,
            }
            for name, p in cfg.cluster.presets.items()
        ]
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health() -> JSONResponse:
        live = [w.instance_id for w in service.workers.values() if not w.is_draining]
        body = {
            "status": "ok" if service.is_ready else "unavailable",
            "gateway_id": cfg.gateway_id,
            "workers": live,
            "in_flight": service.num_in_flight,
        }
        return JSONResponse(body, status_code=200 if service.is_ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
