"""Server-sent events and the two ways a ``Generation`` is answered: streamed or collected.

A stream is ``data: <json>\\n\\n`` events ending with ``data: [DONE]\\n\\n``.
The first output is awaited before the response starts, so a request the
engine rejects still gets a proper 4xx status; an error after that (the
engine stopping) is sent as one ``data: {"error": {...}}`` event.
"""

from __future__ import annotations

import asyncio
import json
import logging
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
    outputs = generation.outputs()
    try:
        first = await anext(outputs)
    except (APIError, StopAsyncIteration) as e:
        await outputs.aclose()
        await generation.close()
        if isinstance(e, APIError):
            raise
        raise APIError(500, "the engine produced no output", code="engine_error") from None

    async def body() -> AsyncIterator[str]:
        try:
            for event in render(*first):
                yield sse_event(event)
            try:
                async for index, out in outputs:
                    for event in render(index, out):
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
