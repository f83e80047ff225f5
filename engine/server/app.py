"""``create_app``: the FastAPI application of the OpenAI-compatible server.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /health``, ``GET /metrics``. Every error is an
OpenAI-style JSON body (see ``errors.py``). With an API key, every route but
``/health`` and ``/metrics`` needs it (``auth.py``). The app does not own the
engine: whoever created the engine starts and shuts it down (``runner.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvtier.engine.server.auth import RequireApiKey, check_api_key
from kvtier.engine.server.chat import create_chat_completion
from kvtier.engine.server.completions import create_completion
from kvtier.engine.server.errors import (
    APIError,
    handle_api_error,
    handle_http_error,
    handle_validation_error,
)
from kvtier.engine.server.generation import EngineClient
from kvtier.engine.server.kv_events import read_kv_events
from kvtier.engine.server.metrics import ServerMetrics
from kvtier.engine.server.protocol import ModelCard, ModelList
from kvtier.engine.server.state import ServerLimits, ServerState, engine_alive

logger = logging.getLogger(__name__)


def connector_registry(engine: object) -> CollectorRegistry | None:
    """The KV connector's Prometheus registry, if the engine's connector has one.

    Looks for ``engine.connector.metrics.registry`` (also through an inner
    ``engine.engine`` when the async engine wraps a synchronous one).
    """
    for holder in (engine, getattr(engine, "engine", None)):
        connector = getattr(holder, "connector", None)
        registry = getattr(getattr(connector, "metrics", None), "registry", None)
        if isinstance(registry, CollectorRegistry):
            return registry
    return None


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(
        500, f"internal server error: {type(exc).__name__}", code="internal_error"
    ).response()


class _CountRequests:
    """Pure ASGI middleware counting answered requests by endpoint and status.

    NOTE: not ``BaseHTTPMiddleware``: that wraps ``receive`` in a way that
    hides a client's disconnect from ``Request.is_disconnected()``, which the
    non-streaming handlers poll to abort abandoned requests.
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.observe(scope["path"], status)


def create_app(
    engine: EngineClient,
    *,
    served_model_name: str | None = None,
    registries: Sequence[CollectorRegistry] = (),
    limits: ServerLimits | None = None,
    server_registry: CollectorRegistry | None = None,
    role: str = "both",
    api_key: str | None = None,
) -> FastAPI:
    """Builds the app around a started engine.

    Args:
        engine: A started ``AsyncLLMEngine`` (or anything with its interface).
        served_model_name: The model name clients use (default: the engine's model id).
        registries: Prometheus registries for ``/metrics`` (e.g. the one given
            to ``EngineMetrics``); the connector's is added at scrape time.
        limits: Request bounds.
        server_registry: Where the server's own HTTP metrics go (default: a
            new registry, also exposed on ``/metrics``).
        role: ``both``, ``prefill`` or ``decode`` (P/D disaggregation); ``/health`` reports it.
        api_key: Clients must send ``Authorization: Bearer <api_key>`` (all
            routes but ``/health`` and ``/metrics``); ``None``: no key needed.

    Raises:
        ValueError: an empty API key, or one an HTTP header cannot carry.
    """
    if api_key is not None:
        check_api_key(api_key)  # now, not at the first request (middleware is built lazily)
    own = server_registry or CollectorRegistry()
    state = ServerState(
        engine=engine,
        served_model_name=served_model_name or engine.model_id,
        registries=[*registries, own],
        metrics=ServerMetrics(own),
        limits=limits or ServerLimits(),
        role=role,
    )
    app = FastAPI(
        title="kvtier engine",
        summary="OpenAI-compatible API of kvtier's bundled paged-attention engine",
        # NOTE: no OpenAPI pages: the handlers parse bodies themselves (strict
        # types, OpenAI error bodies), so a generated schema would be empty.
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.kvtier = state
    app.add_exception_handler(APIError, handle_api_error)
    app.add_exception_handler(RequestValidationError, handle_validation_error)
    app.add_exception_handler(StarletteHTTPException, handle_http_error)
    app.add_exception_handler(Exception, _internal_error)

    if api_key is not None:
        # NOTE: added before _CountRequests, so it runs inside it: refusals are counted.
        app.add_middleware(RequireApiKey, api_key=api_key)
    app.add_middleware(_CountRequests, metrics=state.metrics)

    @app.post("/v1/completions", summary="Text completion (OpenAI-compatible)")
    async def completions(request: Request) -> Response:
        return await create_completion(request, state)

    @app.post("/v1/chat/completions", summary="Chat completion (OpenAI-compatible)")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(request, state)

    @app.get("/v1/models", summary="The served model")
    async def models() -> ModelList:
        card = ModelCard(
            id=state.served_model_name,
            created=state.created,
            root=engine.model_id,
            max_model_len=engine.max_model_len,
        )
        return ModelList(data=[card])

    @app.get("/health", summary="200 while the engine runs and the server accepts requests")
    async def health() -> JSONResponse:
        if state.shutting_down:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        if not engine_alive(engine):
            return JSONResponse({"status": "engine_stopped"}, status_code=503)
        # a P/D role is named; a plain engine ("both") answers as it always did
        return JSONResponse(
            {"status": "ok", **({"role": state.role} if state.role != "both" else {})}
        )

    @app.get("/kv_events", summary="KV events: prefixes stored, evicted, saved (docs/router.md)")
    async def kv_events(request: Request) -> Response:
        return await read_kv_events(request, engine)

    @app.get("/metrics", summary="Prometheus metrics: engine, KV connector, HTTP")
    async def metrics() -> Response:
        regs = list(state.registries)
        extra = connector_registry(engine)
        if extra is not None and extra not in regs:
            regs.append(extra)
        text = b"".join(generate_latest(r) for r in regs)
        engine_text = getattr(engine, "metrics_text", None)
        if engine_text is not None:  # an engine in another process: ask it
            text += await engine_text()
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return app
