"""``GET /kv_events``: the engine's KV events, read with a cursor and long polling.

Query: ``after`` (the ``last_seq`` of the previous answer; 0 at first),
``engine_id`` (the previous answer's: a restarted engine is another log, so
the reader gets a snapshot), ``wait_s`` (hold the request up to this long,
at most 30 s, until there is an event), ``limit`` (batches per answer).
The body is ``KvEventPage.to_json``; the format is in ``docs/router.md``.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from kvtier.engine.kv_events import KvEventLog
from kvtier.engine.server.errors import APIError, bad_request

MAX_WAIT_S = 30.0
MAX_LIMIT = 10_000


def _number(request: Request, name: str, default: float, kind: type[int] | type[float]) -> float:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise bad_request(f"{name} must be a number, got {raw!r}", param=name) from None
    if value < 0:
        raise bad_request(f"{name} must be >= 0, got {raw!r}", param=name)
    return value


async def read_kv_events(request: Request, engine: object) -> JSONResponse:
    """Answers one read of the engine's KV event log.

    Raises:
        APIError: 404 when the engine publishes no events; 400 for a bad query.
    """
    log = getattr(engine, "kv_events", None)
    if not isinstance(log, KvEventLog):
        raise APIError(404, "this engine publishes no KV events", code="not_found")
    after = int(_number(request, "after", 0, int))
    wait_s = min(float(_number(request, "wait_s", 0.0, float)), MAX_WAIT_S)
    limit = max(1, min(int(_number(request, "limit", 1024, int)), MAX_LIMIT))
    engine_id = request.query_params.get("engine_id")
    page = log.read(after, engine_id, limit)
    if not page.reset and not page.events and wait_s > 0:
        await log.wait(after, wait_s)
        page = log.read(after, engine_id, limit)
    body = page.to_json(getattr(engine, "kv_namespace", None), getattr(engine, "block_size", 16))
    return JSONResponse(body)
