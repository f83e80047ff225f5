"""A stream that survives its engine: continued on another engine after a drop or a stall.

::

    engine A ──chunks (text + token ids)──► Transcript ──► client   (A's chunks, ids removed)
       │ drops (connection reset, EOF before the end, an error event)
       │ or stalls (no byte for stall_timeout_s)
       ▼
    A is taken out; another engine B gets POST /v1/completions with
    prompt = prompt ids + generated ids, max_tokens = what is left
       ▼
    B's ids ──► the router renders the text (continuation.TextRenderer) ──► client
    (same id, created, model, object; the final chunk, usage and [DONE] as A's would be)

B finds almost all of that prompt in the shared tier (A saved its prompt and,
with ``save_decode``, its decode-time chunks), so it loads rather than
recomputes it: ``FailoverMetrics`` counts both, from B's
``usage.prompt_tokens_details.cached_tokens``.

A non-streamed request has no bytes before its answer: the proxy re-issues
it whole when its engine drops, or when the health checks have found its
engine down for ``stall_timeout_s`` (a stopped engine).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import httpx
from prometheus_client import CollectorRegistry, Counter

from kvtier.engine.tokenizer import Tokenizer
from kvtier.router.config import RouterConfig
from kvtier.router.continuation import (
    COMPLETION_PATH,
    SSE_DONE,
    NotContinuable,
    SSEParser,
    Transcript,
    sse,
)
from kvtier.router.engines import Engine, EnginePool
from kvtier.router.metrics import RouterMetrics
from kvtier.router.policy import Decision, Reservation

log = logging.getLogger(__name__)
T = TypeVar("T")

_POLL_S = 0.25
_BUSY_RETRIES = 20  # continuations refused with 429 (every engine busy), retried after a pause
_BUSY_PAUSE_S = (0.1, 1.0)  # first pause, longest pause

# (prompt ids, engines not to use) -> the engine picked for a continuation, or None
Picker = Callable[[list[int], set[str]], Awaitable[Decision[Engine] | None]]


class FailoverMetrics:
    """Counters of failover (``/metrics`` and ``GET /failover``; names in docs/router.md)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"kvtier_router_failover_{name}", doc, labels, registry=registry)

        self.streams_interrupted = counter(
            "streams_interrupted", "Streams whose engine dropped or stalled after the first byte"
        )
        self.streams_completed = counter(
            "streams_completed", "Interrupted streams the client got complete (on other engines)"
        )
        self.failed_requests = counter(
            "failed_requests",
            "Requests the router could not complete: an error it answered (no engine, every "
            "attempt failed) or a stream it had to end with an error event",
        )
        self.requests_reissued = counter(
            "requests_reissued",
            "Non-streamed requests re-issued after their engine dropped or stalled",
        )
        self.interruptions = counter(
            "interruptions", "Engines lost mid-stream, by kind (dropped, stalled, engine_error)",
            ("kind",),
        )  # fmt: skip
        self.tokens_loaded_from_tier = counter(
            "tokens_loaded_from_tier",
            "Prompt tokens of continuations their engine reused but did not hold in G1 (as far "
            "as the router knew): loaded from the shared tier",
        )
        self.tokens_from_g1 = counter(
            "tokens_from_g1", "Prompt tokens of continuations found in the engine's own G1"
        )
        self.tokens_recomputed = counter(
            "tokens_recomputed", "Prompt tokens of continuations their engine computed again"
        )

    def snapshot(self) -> dict[str, int]:
        """The counters as ``GET /failover`` answers them."""
        return {
            "streams_interrupted": _value(self.streams_interrupted),
            "streams_completed": _value(self.streams_completed),
            "failed_requests": _value(self.failed_requests),
            "requests_reissued": _value(self.requests_reissued),
            "tokens_loaded_from_tier": _value(self.tokens_loaded_from_tier),
            "tokens_from_g1": _value(self.tokens_from_g1),
            "tokens_recomputed": _value(self.tokens_recomputed),
        }


def _value(c: Counter) -> int:
    return int(sum(s.value for m in c.collect() for s in m.samples if s.name.endswith("_total")))


def track_attempt(
    pool: EnginePool,
    metrics: RouterMetrics,
    engine: Engine,
    pending: int,
    reservation: Reservation | None = None,
) -> Callable[[str], None]:
    """Counts one try at ``engine`` in the pool (in flight, pending prefill, reserved G1).

    The returned ``end(outcome)`` closes the try once, whatever calls it first.
    """
    pool.begin(engine, pending, reservation)
    ended = False

    def end(outcome: str) -> None:
        nonlocal ended
        if not ended:
            ended = True
            pool.first_byte(engine, pending)
            pool.end(engine, reservation)
            metrics.requests.labels(engine.url, outcome).inc()

    return end


@dataclass
class _Leg:
    """How one engine's part of a stream ended."""

    status: str = "running"  # done | dropped | stalled | engine_error
    detail: str = ""


class StreamFailover:
    """Relays a stream, and continues it on other engines when its engine is lost.

    Args:
        config: ``stall_timeout_s``, ``max_failovers``, timeouts.
        pool: The engines (health, in-flight accounting).
        tokenizer: Renders the continued text.
        client: The HTTP client to the engines.
        metrics: The router's metrics.
        fmetrics: Failover's own counters.
        pick: Picks the engine of a continuation (the proxy's policy).
    """

    def __init__(
        self,
        config: RouterConfig,
        pool: EnginePool,
        tokenizer: Tokenizer,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        fmetrics: FailoverMetrics,
        pick: Picker,
    ) -> None:
        self.config = config
        self.pool = pool
        self.tokenizer = tokenizer
        self.client = client
        self.metrics = metrics
        self.fmetrics = fmetrics
        self.pick = pick
        self._max_model_len: dict[str, int] = {}

    # ---- the whole stream --------------------------------------------------------------------

    async def relay(
        self,
        t: Transcript,
        engine: Engine,
        first: bytes,
        chunks: AsyncIterator[bytes],
        resp: httpx.Response,
        end: Callable[[str], None],
        headers: dict[str, str],
        on_done: Callable[[], None] | None = None,
    ) -> AsyncIterator[bytes]:
        """What the client gets: the first engine's chunks, then its continuations
        (``on_done`` is called when the stream is over, however it ended)."""
        current: tuple[httpx.Response, Callable[[str], None]] | None = (resp, end)
        try:
            leg = _Leg()
            async for data in self._pump(t, first, chunks, leg, continued=False):
                yield data
            if leg.status == "done" or t.finish_reason is not None:
                if t.include_usage and not t.usage_sent and leg.status != "done":
                    yield sse(t.usage_chunk())
                yield SSE_DONE
                await _close(resp)
                current = None
                end("ok")
                return
            self._lost(engine, leg)
            await _close(resp)
            current = None
            end("error")
            self.fmetrics.streams_interrupted.inc()
            failed = {engine.url}
            if t.ids_missing:
                log.warning(
                    "engine %s sent no token ids: its stream cannot be continued", engine.url
                )
            losses, busy = 0, 0
            while losses < (self.config.max_failovers if not t.ids_missing else 0):
                cont = await self._start(t, failed, headers)
                if cont == "finished":
                    for event in t.finish_here("length"):
                        yield sse(event)
                    break
                if cont == "busy" and busy < _BUSY_RETRIES:
                    busy += 1
                    await asyncio.sleep(min(_BUSY_PAUSE_S[1], _BUSY_PAUSE_S[0] * 2 ** (busy - 1)))
                    continue
                if not isinstance(cont, _Started):
                    losses += 1
                    continue
                current = (cont.resp, cont.end)
                leg = _Leg()
                async for data in self._pump(t, b"", _chunks(cont.resp), leg, continued=True):
                    yield data
                await _close(cont.resp)
                current = None
                if leg.status == "done" or t.finish_reason is not None:
                    self._count_tokens(t, cont.decision, cont.prompt_len)
                    cont.end("ok")
                    break
                self._lost(cont.engine, leg)
                cont.end("error")
                losses += 1
            if t.finish_reason is None:
                self.fmetrics.failed_requests.inc()
                err = {"error": {"message": "the engine broke off the stream and no other engine "
                                 "could continue it", "type": "server_error", "param": None,
                                 "code": "upstream_error"}}  # fmt: skip
                yield sse(err) + SSE_DONE
                return
            if t.include_usage and not t.usage_sent:
                yield sse(t.usage_chunk())
            yield SSE_DONE
            self.fmetrics.streams_completed.inc()
        finally:
            if current is not None:
                # the client went away (or an error): the engine's request is aborted
                await _close(current[0])
                current[1]("client_closed")
            if on_done is not None:
                on_done()

    # ---- one engine's part ---------------------------------------------------------------------

    async def _pump(
        self,
        t: Transcript,
        first: bytes,
        chunks: AsyncIterator[bytes],
        leg: _Leg,
        continued: bool,
    ) -> AsyncIterator[bytes]:
        """Relays (or, ``continued``, renders) one engine's chunks until it ends or is lost."""
        parser = SSEParser()
        data: bytes | None = first
        while True:
            for payload in parser.feed(data or b""):
                if payload == "[DONE]":
                    leg.status = "done"
                    return
                try:
                    event = json.loads(payload)
                except ValueError:
                    log.warning("an engine sent an event that is not JSON: %.200s", payload)
                    continue
                if not isinstance(event, dict):
                    continue
                if "error" in event and "choices" not in event:
                    leg.status, leg.detail = "engine_error", json.dumps(event["error"])[:300]
                    return
                if continued:
                    for out in t.continued(event):
                        yield sse(out)
                    if t.renderer is not None and t.renderer.stopped and not _final(event):
                        leg.status = "done"  # a stop the engine did not see (across the boundary)
                        return
                else:
                    relayed = t.relayed(event)
                    if relayed is not None:
                        yield sse(relayed)
            try:
                data = await asyncio.wait_for(anext(chunks, None), self.config.stall_timeout_s)
            except TimeoutError:
                leg.status = "stalled"
                return
            except httpx.HTTPError as e:
                leg.status, leg.detail = "dropped", f"{type(e).__name__}: {e}"
                return
            if data is None:
                leg.status = "done" if t.finish_reason is not None else "dropped"
                leg.detail = "the stream ended early"
                return

    def _lost(self, engine: Engine, leg: _Leg) -> None:
        kind = leg.status if leg.status in ("dropped", "stalled", "engine_error") else "dropped"
        self.fmetrics.interruptions.labels(kind).inc()
        self.metrics.upstream_errors.labels(
            engine.url, "dropped" if kind != "stalled" else "timeout"
        ).inc()
        self.pool.set_health(engine, False)  # out until a health check says otherwise
        log.warning("engine %s lost mid-stream (%s %s); continuing on another", engine.url,
                    kind, leg.detail)  # fmt: skip

    # ---- a continuation ------------------------------------------------------------------------

    async def _start(
        self, t: Transcript, failed: set[str], headers: dict[str, str]
    ) -> _Started | str:
        """Starts the continuation on one engine (its first byte awaited), or says
        ``"finished"`` (nothing is left to generate), ``"busy"`` (no engine now, or it
        answered 429: try again after a pause) or ``"failed"`` (try another)."""
        ids = t.prompt_ids + t.ids
        decision = await self.pick(ids, failed)
        if decision is None:
            return "busy"  # no engine serves now: one may come back (a health check)
        engine = decision.engine
        failed.add(engine.url)
        try:
            remaining = t.remaining(await self._context_length(engine, headers))
        except NotContinuable as e:
            log.warning("cannot continue a stream: %s", e)
            return "failed"
        t.start_rendering(self.tokenizer)
        if remaining <= 0:
            return "finished"
        payload = json.dumps(t.continuation_body(remaining)).encode()
        pending = max(0, len(ids) - decision.hit_tokens)
        pool, metrics = self.pool, self.metrics
        end = track_attempt(pool, metrics, engine, pending)

        req = self.client.build_request(
            "POST", engine.url + COMPLETION_PATH, content=payload, headers=headers
        )
        resp: httpx.Response | None = None
        try:
            resp = await self._while_alive(engine, self.client.send(req, stream=True))
            if resp is None or resp.status_code != 200:
                status = "stalled" if resp is None else f"status {resp.status_code}"
                if resp is not None:
                    body = await _read_quietly(resp)
                    log.warning("a continuation on %s failed (%s): %.300s", engine.url, status,
                                body.decode(errors="replace"))  # fmt: skip
                    if resp.status_code >= 500:
                        pool.set_health(engine, False)
                metrics.upstream_errors.labels(engine.url, "status" if resp else "timeout").inc()
                end("error")
                if resp is not None and resp.status_code == 429:
                    failed.discard(engine.url)  # busy, not lost: it may take it in a moment
                    return "busy"
                return "failed"
        except httpx.HTTPError as e:
            metrics.upstream_errors.labels(engine.url, "connect").inc()
            pool.set_health(engine, False)
            log.warning("a continuation on %s failed: %s", engine.url, e)
            end("error")
            return "failed"
        except BaseException:
            if resp is not None:
                await _close(resp)
            end("client_closed")
            raise
        pool.first_byte(engine, pending)
        return _Started(engine, resp, end, decision, len(ids))

    async def _while_alive(self, engine: Engine, work: Awaitable[T]) -> T | None:
        """Awaits ``work`` unless ``engine`` stays out of the pool for ``stall_timeout_s``
        (then None: it is cancelled)."""
        task = asyncio.ensure_future(work)
        down_since: float | None = None
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_POLL_S)
                if done:
                    return task.result()
                if engine.healthy:
                    down_since = None
                elif down_since is None:
                    down_since = time.monotonic()
                elif time.monotonic() - down_since >= self.config.stall_timeout_s:
                    return None
        finally:
            if not task.done():
                with anyio.CancelScope(shield=True):
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)

    async def _context_length(self, engine: Engine, headers: dict[str, str]) -> int | None:
        """The engine's ``max_model_len`` (its ``/v1/models``; both engines report it)."""
        if engine.url in self._max_model_len:
            return self._max_model_len[engine.url]
        try:
            r = await self.client.get(engine.url + "/v1/models", headers=headers, timeout=10)
            value = r.json()["data"][0]["max_model_len"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
            log.debug("no max_model_len from %s: %s", engine.url, e)
            return None
        if isinstance(value, int):
            self._max_model_len[engine.url] = value
            return value
        return None

    def _count_tokens(self, t: Transcript, decision: Decision[Engine], prompt_len: int) -> None:
        """Where the continuation's prompt came from: G1, the shared tier, or computed."""
        cached = t.cached_tokens
        if cached is None:
            log.info("the continuation's engine reported no cached tokens (vLLM needs "
                     "--enable-prompt-tokens-details)")  # fmt: skip
            return
        cached = min(cached, prompt_len)
        from_g1 = min(cached, decision.g1_tokens)
        self.fmetrics.tokens_from_g1.inc(from_g1)
        self.fmetrics.tokens_loaded_from_tier.inc(cached - from_g1)
        self.fmetrics.tokens_recomputed.inc(prompt_len - cached)
        t.cached_tokens = None


@dataclass
class _Started:
    """A continuation whose engine answered."""

    engine: Engine
    resp: httpx.Response
    end: Callable[[str], None]
    decision: Decision[Engine]
    prompt_len: int


def _final(event: dict[str, Any]) -> bool:
    """The engine's own last chunk (it carries a finish reason)."""
    choices = event.get("choices") or []
    return any(isinstance(c, dict) and c.get("finish_reason") is not None for c in choices)


async def _chunks(resp: httpx.Response) -> AsyncIterator[bytes]:
    async for chunk in resp.aiter_raw():
        yield chunk


async def _close(resp: httpx.Response) -> None:
    # NOTE: shielded: this runs when the client went away, inside a cancelled scope
    with anyio.CancelScope(shield=True):
        await resp.aclose()


async def _read_quietly(resp: httpx.Response) -> bytes:
    try:
        return await resp.aread()
    except httpx.HTTPError:
        return b""
    finally:
        await _close(resp)


def reissue_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body sent to the first engine of a stream the router can continue."""
    return {**body, "return_token_ids": True}
