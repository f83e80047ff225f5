"""The router's HTTP app and how it is run.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (routed,
streamed or not), ``GET /v1/models`` (from a healthy engine), ``GET /health``
(200 while some engine can answer), ``GET /metrics`` (the router's own),
``GET /scaling`` (scaling signals and the recommended replica count, JSON),
``GET /failover`` (streams continued on another engine, JSON), ``POST /engines``
(an engine joins, warmed first) and ``GET /warm_start`` (its warm-up, JSON).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from types import TracebackType
from typing import TYPE_CHECKING

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvtier.engine.server.auth import RequireApiKey
from kvtier.engine.tokenizer import Tokenizer
from kvtier.net import bind_listener
from kvtier.router.config import EngineSpec, RouterConfig, RouterConfigError, VllmEventSource
from kvtier.router.engines import Engine, EnginePool
from kvtier.router.events import EventFollower
from kvtier.router.index import PrefixIndex
from kvtier.router.metrics import RouterMetrics
from kvtier.router.policy import Router, Weights
from kvtier.router.proxy import Proxy, error_response
from kvtier.router.scaling_report import RouterSignals, ScalingCollector, SignalsMiddleware
from kvtier.router.tier_events import TierEventFollower
from kvtier.router.warmup import Warmer, WarmMetrics

if TYPE_CHECKING:
    from kvtier.router.vllm_events import VllmEventFollower


class RouterState:
    """Everything one router app holds (built at start-up, on the serving loop)."""

    def __init__(
        self, config: RouterConfig, tokenizer: Tokenizer | None, registry: CollectorRegistry
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = RouterMetrics(registry)
        self.signals = RouterSignals(config, self.metrics)
        registry.register(
            ScalingCollector(self.signals, lambda: self.pool.engines if self.pool else [])
        )
        self.index = PrefixIndex(config.max_saved_keys)
        self.proxy: Proxy | None = None
        self.pool: EnginePool | None = None
        self.follower: EventFollower | None = None
        self.vllm_events: VllmEventFollower | None = None
        self.tier_events: TierEventFollower | None = None
        self.client: httpx.AsyncClient | None = None
        self.warm_metrics = WarmMetrics(registry)
        self.warmer: Warmer | None = None

    async def start(self) -> None:
        c = self.config
        timeout = httpx.Timeout(c.request_timeout_s, connect=c.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)
        headers = {"authorization": f"Bearer {c.engine_api_key}"} if c.engine_api_key else {}
        zmq_fed = {v.engine for v in c.vllm_events}  # vLLM engines: events over ZMQ
        urls = [e.url for e in c.engines if e.url not in zmq_fed]
        self.follower = EventFollower(
            urls, self.client, self.index, self.metrics, wait_s=c.events_wait_s, headers=headers
        )
        self.pool = EnginePool(
            c.engines,
            self.client,
            self.metrics,
            interval_s=c.health_interval_s,
            timeout_s=c.health_timeout_s,
            headers=headers,
            on_down=self._engine_down,
            on_up=self._engine_up,
            signals=self.signals,
        )
        weights = Weights(
            c.decode_cost_tokens, c.shared_hit_weight, c.max_imbalance, c.memory_wait_tokens
        )
        self.proxy = Proxy(c, self.pool, Router(c.policy, weights), self.index, self.follower,
                           self.tokenizer, self.client, self.metrics)  # fmt: skip
        self.warmer = Warmer(self.pool, self.proxy.hot, self.client, self.warm_metrics,
                             max_prefixes=c.warm_max_prefixes, fraction=c.warm_fraction,
                             deadline_s=c.warm_deadline_s, cancel_load=c.warm_cancel_load,
                             headers=headers)  # fmt: skip
        await self.pool.check_all()
        self.pool.start()
        if c.kv_events:
            self.follower.start()
        if c.kv_events and c.vllm_events:
            # NOTE: imported here: pyzmq and msgpack are needed only to follow vLLM engines.
            from kvtier.router.vllm_events import VllmEventFollower

            self.vllm_events = VllmEventFollower(c.vllm_events, self.index, self.metrics,
                                                 self.follower)  # fmt: skip
            self.vllm_events.start()
        if c.tier_events is not None:
            self.tier_events = TierEventFollower(c.tier_events, self.client, self.index,
                self.metrics, wait_s=c.events_wait_s, token=c.tier_events_token)  # fmt: skip
            self.tier_events.start()

    def _follow_vllm(self, source: VllmEventSource) -> None:
        assert self.follower is not None
        if self.vllm_events is None:
            # NOTE: imported here: pyzmq and msgpack are needed only to follow vLLM engines.
            from kvtier.router.vllm_events import VllmEventFollower

            self.vllm_events = VllmEventFollower((), self.index, self.metrics, self.follower)
            self.vllm_events.start()
        self.vllm_events.add(source)

    def _engine_up(self, engine: Engine) -> None:
        """An engine given at start that comes up late, or any engine that comes back (a
        restarted process has lost its G1), is warmed like a joining one when the router
        has hit statistics (at start it has none: nothing to hand over)."""
        w = self.warmer
        if w is None or engine.warming or self.config.warm_max_prefixes <= 0 or not len(w.hot):
            return
        engine.warming = True
        w.start(engine)

    def _engine_down(self, url: str) -> None:
        if self.follower is not None:
            self.follower.engine_down(url)
        if self.vllm_events is not None:
            self.vllm_events.engine_down(url)

    async def add_engine(
        self, spec: EngineSpec, warm: bool, vllm_events: VllmEventSource | None = None
    ) -> dict[str, object]:
        """An engine joins at runtime; warmed first when ``warm`` (and warm-up is on). A vLLM
        engine's KV events (``vllm_events``) are followed over ZMQ, as ``--vllm-kv-events``
        does at start; any other engine's at ``/kv_events``.

        Raises:
            ValueError: if it is already in the pool.
        """
        assert self.pool is not None and self.follower is not None and self.warmer is not None
        if spec.url in self.pool.by_url:
            raise ValueError(f"engine {spec.url} is already in the pool")
        warm = warm and self.config.warm_max_prefixes > 0
        if self.config.kv_events and vllm_events is not None:
            self._follow_vllm(vllm_events)
        engine = await self.pool.add(spec, warming=warm)
        if self.config.kv_events and vllm_events is None:
            self.follower.follow(engine.url)
        if warm:
            self.warmer.start(engine)
        return {"url": engine.url, "role": engine.role, "healthy": engine.healthy,
                "warming": engine.warming}  # fmt: skip

    async def stop(self) -> None:
        if self.warmer is not None:
            await self.warmer.stop()
        if self.follower is not None:
            await self.follower.stop()
        if self.vllm_events is not None:
            await self.vllm_events.stop()
        if self.tier_events is not None:
            await self.tier_events.stop()
        if self.pool is not None:
            await self.pool.stop()
        if self.client is not None:
            await self.client.aclose()


def create_router_app(
    config: RouterConfig,
    tokenizer: Tokenizer | None = None,
    registry: CollectorRegistry | None = None,
) -> FastAPI:
    """The router app (its engines are checked and followed while it serves).

    Args:
        config: How to route.
        tokenizer: The model's tokenizer (for prompt keys); None routes without keys.
        registry: Where the router's metrics go (default: a new one).
    """
    state = RouterState(config, tokenizer, registry or CollectorRegistry())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(
        title="kvtier router", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.state.router = state
    if config.api_key is not None:
        # the engine server's check: constant-time, /health and /metrics open, 401 otherwise
        app.add_middleware(RequireApiKey, api_key=config.api_key)
    app.add_middleware(SignalsMiddleware, signals=state.signals)  # outermost: times the answer

    def proxy() -> Proxy:
        assert state.proxy is not None, "the router is not started"
        return state.proxy

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy().handle(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy().handle(request, "/v1/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        assert state.pool is not None and state.client is not None
        headers = proxy().upstream_headers(request)
        for e in state.pool.serving(("both", "decode", "prefill")):
            try:
                r = await state.client.get(e.url + "/v1/models", headers=headers)
            except httpx.HTTPError:
                continue
            if r.status_code in (200, 401):  # a refused key is the client's to see
                return Response(r.content, r.status_code, media_type="application/json")
        return error_response(503, "no engine is available", "no_engine_available")

    @app.get("/health")
    async def health() -> JSONResponse:
        assert state.pool is not None
        engines = {e.url: {"healthy": e.healthy, "role": e.role, "in_flight": e.in_flight,
                           "warming": e.warming} for e in state.pool.engines}  # fmt: skip
        roles = ("decode", "both") if config.disaggregated else ("both",)
        ok = bool(state.pool.serving(roles))
        return JSONResponse(
            {"status": "ok" if ok else "no_engine", "engines": engines}, 200 if ok else 503
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/failover")
    async def failover() -> JSONResponse:
        """Streams interrupted / completed, failed requests, continuation tokens (docs/router.md)."""
        return JSONResponse(proxy().failover_metrics.snapshot())

    @app.post("/engines")
    async def add_engine(request: Request) -> Response:
        """``{"url": ..., "role": "both", "warm": true}``: an engine joins (docs/router.md)."""
        try:
            body = await request.json()
            if not isinstance(body, dict) or not isinstance(body.get("url"), str):
                raise ValueError("the body must be a JSON object with a 'url'")
            spec = EngineSpec(body["url"], body.get("role", "both"))
            if spec.role == "prefill" and not config.disaggregated:
                raise ValueError("a prefill engine joins only a P/D router")
            warm = body.get("warm", True)
            if not isinstance(warm, bool):
                raise ValueError("'warm' must be true or false")
            events = body.get("vllm_kv_events")
            source = None if events is None else VllmEventSource.from_body(spec.url, events)
        except (ValueError, RouterConfigError) as e:
            return error_response(400, str(e), "invalid_engine")
        try:
            added = await state.add_engine(spec, warm, source)
        except ValueError as e:
            return error_response(409, str(e), "engine_exists")
        return JSONResponse(added, 201)

    @app.get("/warm_start")
    async def warm_start() -> JSONResponse:
        """Each joining engine's warm-up: prefixes, tokens, duration (docs/router.md)."""
        assert state.warmer is not None
        return JSONResponse(state.warmer.snapshot())

    @app.get("/scaling")
    async def scaling() -> JSONResponse:
        assert state.pool is not None
        return JSONResponse(state.signals.report(state.pool.engines))

    return app


def _config(app: FastAPI, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        app, log_level=log_level, access_log=False, lifespan="on", timeout_graceful_shutdown=5
    )


def serve_router(app: FastAPI, host: str, port: int, log_level: str = "warning") -> None:
    """Serves until SIGTERM/SIGINT."""
    sock = bind_listener(host, port)
    try:
        uvicorn.Server(_config(app, log_level)).run(sockets=[sock])
    finally:
        sock.close()


class BackgroundRouter:
    """The router on a background thread (its own loop), for tests and benchmarks."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self._sock = bind_listener(host, port)
        self.host, self.port = self._sock.getsockname()[:2]
        self._server = uvicorn.Server(_config(app, "warning"))
        self._thread = threading.Thread(target=self._run, name="kvtier-router", daemon=True)
        self.app = app

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def state(self) -> RouterState:
        state: RouterState = self.app.state.router
        return state

    def _run(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._sock]))

    def start(self, timeout_s: float = 60.0) -> BackgroundRouter:
        """Returns once the router accepts connections.

        Raises:
            RuntimeError: if it does not start in time.
        """
        self._thread.start()
        done = threading.Event()
        waited = 0.0
        while not self._server.started and self._thread.is_alive() and waited < timeout_s:
            done.wait(0.02)
            waited += 0.02
        if not self._server.started:
            self.close()
            raise RuntimeError("the router did not start")
        return self

    def close(self, timeout_s: float = 30.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> BackgroundRouter:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
