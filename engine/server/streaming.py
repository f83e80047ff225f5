"""Server-sent events and the two ways a ``Generation`` is answered: streamed or collected.

A stream is ``data: <json>\\n\\n`` events ending with ``data: [DONE]\\n\\n``.
The first output is awaited before the response starts, so a request the
engine rejects still gets a proper 4xx status; an error after that (the
engine stopping) is sent as one ``data: {"error": {...}}`` event.

A started stream that waits ``HEARTBEAT_S`` for its next output (its decode
shares steps with other requests' long prefill chunks) gets an SSE comment,
``: keep-alive``, which clients ignore (the SSE format says so; OpenAI's
clients do), as long as the engine finished a step in the last
``PROGRESS_WINDOW_S``: the comment says the engine works, not only that its
HTTP server does. ``kvtier router`` takes an engine that sends no byte for
``--stall-timeout`` (30 s) mid-stream for a stalled one and continues the
stream elsewhere. Without the comment, a float32 engine on a 2-vCPU host
priming two 3,000-token documents at a time was taken out as stalled 27 s
after the first request, and again 50 s later, while it worked; each
continuation sent the work back to it. An engine whose steps stop still goes
silent (after ``PROGRESS_WINDOW_S``), and a stopped process at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvtier.engine.outputs import RequestOutput
from kvtier.engine.server.errors import APIError
from kvtier.engine.server.generation import Generation

logger = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"
SSE_KEEP_ALIVE = ": keep-alive\n\n"
HEARTBEAT_S = 5.0  # well under kvtier router's default stall timeout (30 s)
PROGRESS_WINDOW_S = 60.0  # heartbeats stop this long after the engine's last step
_DISCONNECT_POLL_S = 0.25

# (choice index, output) -> events to send (possibly none)
Render = Callable[[int, RequestOutput], Iterable[BaseModel]]
# called once after the last output -> closing events (e.g. usage)
Tail = Callable[[], Iterable[BaseModel]]


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    """One ``data:`` event."""
    text = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {text}\n\n"


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that always cleans up after itself.

    Whatever ends the response — the last event, a client that disconnected,
    a send that failed, a response that never started — ``close`` runs (it
    aborts unfinished engine requests) and then ``release`` (frees the slot).
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[str],
        close: Callable[[], Awaitable[None]],
        release: Callable[[], None],
    ) -> None:
        super().__init__(
            content,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._content = content
        self._close = close
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                aclose = getattr(self._content, "aclose", None)
                if aclose is not None:
                    await aclose()
                await self._close()
            finally:
                self._release()


class Progress:
    """Whether the engine finished a step in the last ``window_s`` (its steps are its pulse)."""

    def __init__(self, steps: Callable[[], int], window_s: float = PROGRESS_WINDOW_S) -> None:
        self._steps, self._window_s = steps, window_s
        self._last, self._at = steps(), time.monotonic()

    def __call__(self) -> bool:
        n, now = self._steps(), time.monotonic()
        if n != self._last:
            self._last, self._at = n, now
        return now - self._at < self._window_s


async def start_stream(
    generation: Generation, render: Render, tail: Tail, release: Callable[[], None]
) -> SSEResponse:
    """Waits for the first output, then streams the rest as server-sent events.

    Args:
        generation: The engine requests.
        render: Turns an output into events.
        tail: Events after the last output.
        release: Called once when the response is over (frees the request slot).

    Raises:
        APIError: if the engine rejects the request before its first output
            (the generation is closed then; ``release`` is left to the caller).
    """
    outputs = generation.outputs(HEARTBEAT_S)
    try:
        first = await anext(outputs)
        while first is None:  # no heartbeat before the response starts
            first = await anext(outputs)
    except (APIError, StopAsyncIteration) as e:
        await outputs.aclose()
        await generation.close()
        if isinstance(e, APIError):
            raise
        raise APIError(500, "the engine produced no output", code="engine_error") from None

    progress = Progress(generation.engine_steps)

    async def body() -> AsyncIterator[str]:
        try:
            for event in render(*first):
                yield sse_event(event)
            try:
                async for item in outputs:
                    if item is None:
                        if progress():
                            yield SSE_KEEP_ALIVE
                        continue
                    for event in render(*item):
                        yield sse_event(event)
                for event in tail():
                    yield sse_event(event)
            except APIError as e:
                logger.warning("stream ended by an engine error: %s", e.message)
                yield sse_event(e.body())
            yield SSE_DONE
        finally:
            await outputs.aclose()
            await generation.close()

    return SSEResponse(body(), generation.close, release)


async def collect_unless_disconnected(
    request: Request, generation: Generation
) -> list[RequestOutput]:
    """Runs a generation to the end; aborts it if the client goes away first.

    Raises:
        APIError: from the engine, or 499 (client closed request) after an abort.
    """
    task = asyncio.ensure_future(generation.collect())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client closed the request", code="client_closed_request")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await generation.close()
