"""Forwarding a request: pick an engine, send, retry on another before the first byte, relay.

::

    body ─► prompt ids + keys (a worker thread) ─► [P/D: prefill leg, max_tokens 1,
    on a prefill engine; its answer is dropped] ─► pick an engine ─► POST
         connect error / 429 / 5xx / dropped before the first byte ─► the next engine
         (at most max_attempts engines; a dead one is taken out at once)
    streamed:  the first bytes are awaited, then relayed as they come; an engine
               that breaks off or stalls mid-stream: the stream is continued on
               another engine (failover.py), or, if it cannot be, ended with an
               error event
    not streamed: the whole answer is read (and abandoned if the client goes away;
               re-issued on another engine if its engine drops or stays down)

A client that disconnects closes the connection to the engine, which aborts
the request there (the bundled engine and vLLM both do).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvtier.engine.tokenizer import Tokenizer
from kvtier.router.config import Role, RouterConfig
from kvtier.router.continuation import Transcript, continuable
from kvtier.router.engines import Engine, EnginePool
from kvtier.router.events import EventFollower
from kvtier.router.failover import FailoverMetrics, StreamFailover, reissue_body, track_attempt
from kvtier.router.index import PrefixIndex, PromptKeys, prompt_keys
from kvtier.router.metrics import RouterMetrics
from kvtier.router.policy import Candidate, Decision, Reservation, Router
from kvtier.router.prompt import prompt_token_ids
from kvtier.router.warmup import HotPrefixes

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
_GONE = "client-gone"  # the prefill leg's answer when the client left
_DISCONNECT_POLL_S = 0.25
ENGINE_HEADER = "x-kvtier-engine"
PREFILL_HEADER = "x-kvtier-prefill-engine"


def error_response(status: int, message: str, code: str) -> JSONResponse:
    """An OpenAI-style error body."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status)


class RelayResponse(StreamingResponse):
    """A streamed answer whose generator is always closed (it closes the engine's stream)."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        status_code: int,
        headers: dict[str, str],
        media_type: str | None,
    ) -> None:
        super().__init__(content, status_code=status_code, headers=headers, media_type=media_type)
        self._content = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._content, "aclose", None)
            if aclose is not None:
                await aclose()


@dataclass
class RoutedPrompt:
    """What the router knows of one request's prompt."""

    ids: list[int] | None
    keys: dict[tuple[Any, int], PromptKeys]  # (namespace, block size) -> the prompt's keys
    answer_tokens: int = 0  # its max_tokens (0: not given): with the prompt, the G1 it holds

    @property
    def num_tokens(self) -> int:
        return len(self.ids) if self.ids is not None else 0


def answer_budget(body: dict[str, Any]) -> int:
    """The most tokens a request may generate (``max_completion_tokens``, ``max_tokens``; 0: not
    given or not a positive integer)."""
    for name in ("max_completion_tokens", "max_tokens"):
        v = body.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 0


class _ClientGone(Exception):
    """The client disconnected while a whole answer was awaited."""


class _EngineLost(Exception):
    """The engine stayed out of the pool for ``stall_timeout_s`` while its answer was awaited."""


class Proxy:
    """Routes and forwards the OpenAI generation routes.

    Args:
        config: The router's configuration.
        pool: The engines.
        router: The policy.
        index: What engines hold.
        follower: Their KV events (namespaces).
        tokenizer: The model's tokenizer (None: no prompt keys).
        client: The HTTP client to the engines.
        metrics: The router's metrics.
    """

    def __init__(
        self,
        config: RouterConfig,
        pool: EnginePool,
        router: Router,
        index: PrefixIndex,
        follower: EventFollower,
        tokenizer: Tokenizer | None,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
    ) -> None:
        self.config = config
        self.pool = pool
        self.router = router
        self.index = index
        self.follower = follower
        self.tokenizer = tokenizer
        self.client = client
        self.metrics = metrics
        self._headers = (
            {"authorization": f"Bearer {config.engine_api_key}"} if config.engine_api_key else {}
        )
        self.failover_metrics = FailoverMetrics(metrics.registry)
        self.hot = HotPrefixes(config.hot_prefixes)  # hit statistics (warm-up's candidates)
        self.failover = (
            StreamFailover(config, pool, tokenizer, client, metrics, self.failover_metrics,
                           self.pick_continuation)
            if config.failover and tokenizer is not None
            else None
        )  # fmt: skip

    def upstream_headers(self, request: Request) -> dict[str, str]:
        """What the engines are sent: the router's engine key, else the client's own."""
        headers = dict(self._headers)
        if not headers and "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        return headers

    # ---- prompt ----------------------------------------------------------------------------

    def _prompt(
        self, path: str, body: dict[str, Any], spaces: set[tuple[Any, int]]
    ) -> RoutedPrompt:
        """Prompt ids and their keys in every namespace the engines use (a worker thread)."""
        if self.tokenizer is None:
            return RoutedPrompt(None, {})
        ids = prompt_token_ids(self.tokenizer, path, body)
        if ids is None:
            return RoutedPrompt(None, {})
        keys = {(ns, bs): prompt_keys(ids, ns, bs) for ns, bs in spaces}
        return RoutedPrompt(ids, keys, answer_budget(body))

    def _candidates(self, engines: list[Engine], prompt: RoutedPrompt) -> list[Candidate]:
        out = []
        for e in engines:
            space = self.follower.namespace(e.url)
            pk = prompt.keys.get(space) if space is not None else None
            if pk is None:
                out.append(Candidate(e))
            else:
                out.append(
                    Candidate(e, self.index.g1_tokens(e.url, pk), self.index.shared_tokens(pk))
                )
        return out

    async def pick_continuation(self, ids: list[int], exclude: set[str]) -> Decision[Engine] | None:
        """The engine that continues a stream whose prompt is now ``ids`` (None: none left)."""
        engines = [e for e in self.pool.serving(("decode", "both")) if e.url not in exclude]
        if not engines:
            return None
        # NOTE: keys under every policy: what the engine holds in G1 tells the tokens it
        # loads from the shared tier apart (failover's metrics)
        spaces = {s for e in engines if (s := self.follower.namespace(e.url)) is not None}
        prompt = await asyncio.to_thread(
            lambda: RoutedPrompt(ids, {(ns, bs): prompt_keys(ids, ns, bs) for ns, bs in spaces})
        )
        cands = self._candidates(engines, prompt)
        decision = self.router.pick(cands, len(ids), True)
        self.metrics.decisions.labels(self.config.policy, decision.reason).inc()
        held = next(c for c in cands if c.engine is decision.engine)
        return dataclasses.replace(decision, g1_tokens=held.g1_tokens)

    # ---- entry point -------------------------------------------------------------------------

    async def handle(self, request: Request, path: str) -> Response:
        """Answers one ``POST /v1/...completions`` request."""
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as e:
            return error_response(400, f"the body is not valid JSON: {e}", "invalid_json")
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object", "invalid_json")
        headers = self.upstream_headers(request)
        headers["content-type"] = "application/json"
        spaces = set()
        if self.config.policy == "cache_aware":
            spaces = {s for u in self.pool.by_url if (s := self.follower.namespace(u)) is not None}
        prompt = await asyncio.to_thread(self._prompt, path, body, spaces)
        if prompt.ids is not None:
            self.metrics.prompt_tokens.inc(prompt.num_tokens)
        stream = body.get("stream") is True
        extra: dict[str, str] = {}
        roles: tuple[Role, ...] = ("both",)
        if self.config.disaggregated:
            roles = ("decode", "both")
            prefill_engine = await self._prefill_leg(request, path, body, headers, prompt)
            if prefill_engine == _GONE:
                return Response(status_code=499)  # the client left during the prefill leg
            if prefill_engine is not None:
                extra[PREFILL_HEADER] = prefill_engine
        leg = "decode" if self.config.disaggregated else "direct"
        transcript = None
        if self.failover is not None and prompt.ids is not None and continuable(path, body) is None:
            transcript = Transcript(path, body, prompt.ids)
            raw = json.dumps(reissue_body(body)).encode()  # the chunks carry their token ids
        return await self._forward(
            request, path, raw, headers, stream, prompt, roles, leg, extra, transcript
        )

    async def _prefill_leg(
        self,
        request: Request,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        prompt: RoutedPrompt,
    ) -> str | None:
        """Runs the prompt on a prefill engine (one token), so its KV reaches the shared tier.

        Returns the engine's URL, None when it failed (the decode engine then
        computes the prompt itself: a failed prefill is a miss, not an error), or
        ``_GONE`` when the client went away meanwhile.
        """
        leg_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        leg_body["max_tokens"] = 1
        if "max_completion_tokens" in leg_body:
            leg_body["max_completion_tokens"] = 1
        payload = json.dumps(leg_body).encode()
        resp = await self._forward(
            request, path, payload, headers, False, prompt, ("prefill",), "prefill", {}
        )
        if resp.status_code == 499:
            return _GONE
        if resp.status_code != 200:
            log.warning(
                "prefill leg failed (%d); the decode engine computes the prompt", resp.status_code
            )
            return None
        return resp.headers.get(ENGINE_HEADER)

    # ---- attempts ------------------------------------------------------------------------------

    async def _forward(
        self,
        request: Request,
        path: str,
        payload: bytes,
        headers: dict[str, str],
        stream: bool,
        prompt: RoutedPrompt,
        roles: tuple[Role, ...],
        leg: str,
        extra_headers: dict[str, str],
        transcript: Transcript | None = None,
    ) -> Response:
        tried: set[str] = set()
        last_error: Response | None = None
        reissue = False  # the last attempt was lost while its engine answered
        for attempt in range(self.config.max_attempts):
            engines = [e for e in self.pool.serving(roles) if e.url not in tried]
            if not engines:
                break
            cands = (
                self._candidates(engines, prompt)
                if self.config.policy == "cache_aware"
                else [Candidate(e) for e in engines]
            )
            answer = 1 if leg == "prefill" else prompt.answer_tokens
            decision = self.router.pick(cands, prompt.num_tokens, prompt.ids is not None, answer)
            self.metrics.decisions.labels(self.config.policy, decision.reason).inc()
            if log.isEnabledFor(logging.DEBUG):
                log.debug("routed %d prompt tokens to %s (%s): %s", prompt.num_tokens,
                          decision.engine.url, decision.reason, _describe(cands))  # fmt: skip
            if attempt:
                self.metrics.retries.inc()
            if reissue:
                self.failover_metrics.requests_reissued.inc()
            engine = decision.engine
            tried.add(engine.url)
            pending = max(0, prompt.num_tokens - decision.hit_tokens)
            kv = prompt.num_tokens + answer
            held = Reservation(kv, answer, kv - decision.hit_tokens)
            outcome = await self._attempt(
                request, engine, path, payload, headers, stream, pending, leg, transcript, held
            )
            if isinstance(outcome, Response):
                if prompt.ids is not None and leg != "prefill":
                    held = max(decision.g1_tokens, decision.shared_tokens)
                    self.hot.observe(prompt.ids, max(held, self.hot.repeats(prompt.ids)))
                if decision.g1_tokens:
                    self.metrics.matched_tokens.labels("g1").inc(decision.g1_tokens)
                if decision.hit_tokens > decision.g1_tokens:
                    self.metrics.matched_tokens.labels("shared").inc(
                        decision.hit_tokens - decision.g1_tokens
                    )
                outcome.headers[ENGINE_HEADER] = engine.url
                for k, v in extra_headers.items():
                    outcome.headers[k] = v
                return outcome
            last_error = outcome.response
            reissue = outcome.answering and leg != "prefill"
        self.metrics.requests.labels("none", "error").inc()
        if leg != "prefill":  # a failed prefill leg is a miss: the decode engine computes it
            self.failover_metrics.failed_requests.inc()
        if last_error is not None:
            return last_error
        which = "/".join(roles)
        return error_response(503, f"no {which} engine is available", "no_engine_available")

    async def _attempt(
        self,
        request: Request,
        engine: Engine,
        path: str,
        payload: bytes,
        headers: dict[str, str],
        stream: bool,
        pending: int,
        leg: str,
        transcript: Transcript | None = None,
        reservation: Reservation | None = None,
    ) -> Response | _Failed:
        """One try at ``engine``: a response to give the client, or a failure to retry."""
        pool, metrics = self.pool, self.metrics
        end = track_attempt(pool, metrics, engine, pending, reservation)
        started = time.perf_counter()

        try:
            req = self.client.build_request(
                "POST", engine.url + path, content=payload, headers=headers
            )
            watch = (engine, self.config.stall_timeout_s) if self.config.failover else None
            try:
                # NOTE: a non-streamed answer's head comes with its end: the wait is the answer
                sent = self.client.send(req, stream=True)
                resp = await _unless_disconnected(request, sent, watch)
            except _ClientGone:
                end("client_closed")
                return Response(status_code=499)
            except (httpx.HTTPError, _EngineLost) as e:
                failed = self._lost(engine, e, end)
                connect = isinstance(e, httpx.ConnectError)
                return failed if stream or connect else dataclasses.replace(failed, answering=True)
            if resp.status_code in RETRY_STATUSES:
                data = await _read_quietly(resp)
                metrics.upstream_errors.labels(engine.url, "status").inc()
                if resp.status_code == 503:
                    pool.set_health(engine, False)  # stopping or its engine died: out until healthy
                end("error")
                return _Failed(
                    Response(data, resp.status_code, media_type=resp.headers.get("content-type"))
                )
            if stream and resp.status_code == 200:
                chunks = resp.aiter_raw()
                try:
                    first = await _unless_disconnected(request, anext(chunks, b""))
                except (_ClientGone, httpx.HTTPError) as e:
                    with anyio.CancelScope(shield=True):
                        await resp.aclose()
                    if isinstance(e, _ClientGone):
                        end("client_closed")
                        return Response(status_code=499)
                    return self._failed(engine, e, end)
                pool.first_byte(engine, pending)
                metrics.legs.labels(f"{leg}_first_byte" if leg != "prefill" else leg).observe(
                    time.perf_counter() - started
                )
                if transcript is not None and self.failover is not None:
                    relay = self.failover.relay(
                        transcript, engine, first, chunks, resp, end, headers,
                        lambda: metrics.legs.labels(leg).observe(time.perf_counter() - started),
                    )  # fmt: skip
                else:
                    relay = self._relay(engine, first, chunks, resp, end, leg, started)
                ctype = resp.headers.get("content-type", "text/event-stream")
                return RelayResponse(
                    relay, 200, {"cache-control": "no-cache", "x-accel-buffering": "no"}, ctype
                )
            try:
                data = await _unless_disconnected(request, _read_body(resp), watch)
            except _ClientGone:
                end("client_closed")
                return Response(status_code=499)
            except (httpx.HTTPError, _EngineLost) as e:
                return dataclasses.replace(self._lost(engine, e, end), answering=True)
            elapsed = time.perf_counter() - started
            metrics.legs.labels(leg).observe(elapsed)
            if leg != "prefill":
                metrics.legs.labels(f"{leg}_first_byte").observe(elapsed)
            end("ok" if resp.status_code < 400 else "error")
            return Response(data, resp.status_code, media_type=resp.headers.get("content-type"))
        except BaseException:
            end("error")
            raise

    def _lost(
        self, engine: Engine, e: httpx.HTTPError | _EngineLost, end: Callable[[str], None]
    ) -> _Failed:
        """An engine failed (``_failed``) or stayed out of the pool (``_EngineLost``)."""
        if isinstance(e, httpx.HTTPError):
            return self._failed(engine, e, end)
        self.metrics.upstream_errors.labels(engine.url, "timeout").inc()
        end("error")
        log.warning("engine %s was out for %.1f s while answering; trying another", engine.url,
                    self.config.stall_timeout_s)  # fmt: skip
        return _Failed(error_response(502, f"engine {engine.url} stalled", "upstream_error"))

    def _failed(self, engine: Engine, e: httpx.HTTPError, end: Callable[[str], None]) -> _Failed:
        kind = (
            "connect"
            if isinstance(e, httpx.ConnectError)
            else ("timeout" if isinstance(e, httpx.TimeoutException) else "dropped")
        )
        self.metrics.upstream_errors.labels(engine.url, kind).inc()
        if kind in ("connect", "dropped"):
            self.pool.set_health(engine, False)  # dead until a health check says otherwise
        end("error")
        log.warning(
            "engine %s failed before the first byte (%s: %s); trying another", engine.url, kind, e
        )
        return _Failed(error_response(502, f"engine {engine.url} failed: {kind}", "upstream_error"))

    async def _relay(
        self,
        engine: Engine,
        first: bytes,
        chunks: AsyncIterator[bytes],
        resp: httpx.Response,
        end: Callable[[str], None],
        leg: str,
        started: float,
    ) -> AsyncIterator[bytes]:
        outcome = "client_closed"
        try:
            if first:
                yield first
            try:
                async for chunk in chunks:
                    yield chunk
                outcome = "ok"
            except httpx.HTTPError as e:
                outcome = "error"
                self.failover_metrics.streams_interrupted.inc()
                self.failover_metrics.failed_requests.inc()
                self.metrics.upstream_errors.labels(engine.url, "dropped").inc()
                log.warning("an engine broke off a stream: %s", e)
                err = {"error": {"message": f"the engine broke off the stream: {type(e).__name__}",
                                 "type": "server_error", "param": None, "code": "upstream_error"}}  # fmt: skip
                yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            # NOTE: shielded: when the client goes away this runs inside a cancelled
            # scope, and an unshielded close would be cancelled before the engine's
            # connection is closed (the engine would never see the abort).
            with anyio.CancelScope(shield=True):
                await resp.aclose()
            self.metrics.legs.labels(leg).observe(time.perf_counter() - started)
            end(outcome)


@dataclass(frozen=True)
class _Failed:
    """An attempt that may be retried; ``response`` is what the client gets if none succeeds;
    ``answering``: the engine had the request and was lost while answering it."""

    response: Response
    answering: bool = False


async def _read_quietly(resp: httpx.Response) -> bytes:
    try:
        return await resp.aread()
    except httpx.HTTPError:
        return b""
    finally:
        await resp.aclose()


async def _unless_disconnected(
    request: Request, work: Awaitable[T], watch: tuple[Engine, float] | None = None
) -> T:
    """Awaits ``work``; if the client goes away first (or, with ``watch``, the engine
    stays out of the pool for that many seconds), ``work`` is cancelled (which
    closes its connection to the engine: the engine aborts the request).

    Raises:
        _ClientGone: the client disconnected.
        _EngineLost: the watched engine was out too long.
    """
    task = asyncio.ensure_future(work)
    down_since: float | None = None
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise _ClientGone()
            if watch is not None:
                if watch[0].healthy:
                    down_since = None
                elif down_since is None:
                    down_since = time.monotonic()
                elif time.monotonic() - down_since >= watch[1]:
                    raise _EngineLost()
    finally:
        if not task.done():
            with anyio.CancelScope(shield=True):
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


async def _read_body(resp: httpx.Response) -> bytes:
    try:
        return await resp.aread()
    finally:
        with anyio.CancelScope(shield=True):
            await resp.aclose()


def _describe(cands: list[Candidate]) -> str:
    """The candidates as a decision's debug line shows them."""
    return "; ".join(
        f"{c.engine.url} load {c.engine.in_flight}/{c.engine.reported_load} "
        f"pending {c.engine.pending_prefill_tokens} g1 {c.g1_tokens} shared {c.shared_tokens} "
        f"held {sum(r.kv_tokens for r in c.engine.reservations)}/{c.engine.kv_capacity_tokens}"
        for c in cands
    )
