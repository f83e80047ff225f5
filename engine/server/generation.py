"""``Generation``: the engine requests behind one HTTP request, and their clean-up.

One engine request runs per prompt (``/v1/completions`` accepts several).
Whatever way the HTTP request ends — finished, client gone, error, server
shutting down — ``close()`` aborts every engine request that has not
finished, so its KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

import anyio

from kvtier.engine.errors import EngineDeadError, EngineError, InvalidRequestError
from kvtier.engine.outputs import EngineStats, RequestOutput
from kvtier.engine.sampling_params import SamplingParams
from kvtier.engine.server.errors import APIError, from_invalid_request
from kvtier.engine.server.inputs import TokenizerLike

logger = logging.getLogger(__name__)


class EngineClient(Protocol):
    """What the server needs of ``AsyncLLMEngine``."""

    @property
    def tokenizer(self) -> TokenizerLike: ...

    @property
    def model_id(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> Any: ...

    def stats(self) -> EngineStats: ...


def engine_error(e: EngineError) -> APIError:
    """Maps an engine error to the HTTP error the client sees."""
    if isinstance(e, InvalidRequestError):
        return from_invalid_request(e)
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine is not running: {e}", code="engine_unavailable")
    return APIError(500, f"engine error: {e}", code="engine_error")


class Generation:
    """Runs one prompt per engine request and merges their outputs.

    Args:
        engine: The engine.
        base_id: Request id prefix; engine request ``i`` is ``f"{base_id}-{i}"``.
        prompts: Token ids, one list per choice.
        params: Shared sampling parameters (copied per request).
    """

    def __init__(
        self,
        engine: EngineClient,
        base_id: str,
        prompts: Sequence[list[int]],
        params: SamplingParams,
    ) -> None:
        self._engine = engine
        self.request_ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        self._iters: list[AsyncIterator[RequestOutput]] = [
            engine.generate(list(ids), dataclasses.replace(params), rid)
            for ids, rid in zip(prompts, self.request_ids, strict=True)
        ]
        self._pending: dict[asyncio.Task[RequestOutput], int] = {}
        self.finals: list[RequestOutput | None] = [None] * len(prompts)
        self._closed = False

    def engine_steps(self) -> int:
        """The engine's steps so far (its pulse: ``streaming.Progress``)."""
        return self._engine.stats().num_steps

    @property
    def finished(self) -> bool:
        """True once every engine request reported its final output."""
        return all(f is not None for f in self.finals)

    def _schedule(self, index: int) -> None:
        task = asyncio.ensure_future(anext(self._iters[index]))
        self._pending[task] = index

    async def outputs(
        self, wait_s: float | None = None
    ) -> AsyncIterator[tuple[int, RequestOutput] | None]:
        """Yields ``(choice index, output)`` as the engine produces them, in arrival order;
        with ``wait_s``, also ``None`` each time that passes without one (a stream's
        heartbeat: ``streaming.py``).

        Raises:
            APIError: if the engine rejects a request or stops.
        """
        for i in range(len(self._iters)):
            self._schedule(i)
        while self._pending:
            done, _ = await asyncio.wait(
                self._pending, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                yield None
                continue
            for task in done:
                index = self._pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                except EngineError as e:
                    raise engine_error(e) from e
                if out.finished:
                    self.finals[index] = out
                else:
                    self._schedule(index)
                yield index, out

    async def collect(self) -> list[RequestOutput]:
        """Runs every request to the end; returns the final outputs in choice order.

        Raises:
            APIError: as ``outputs``; also a 500 if a request ended without a final output.
        """
        async for _ in self.outputs():
            pass
        finals = [f for f in self.finals if f is not None]
        if len(finals) != len(self.finals):
            raise APIError(
                500, "the engine ended a request without a final output", code="engine_error"
            )
        return finals

    async def close(self) -> None:
        """Aborts every unfinished engine request and releases its stream (idempotent).

        Shielded from cancellation: it runs when the client has gone and the
        response task is being cancelled, which is exactly when the engine
        must be told.
        """
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            for rid, final in zip(self.request_ids, self.finals, strict=True):
                if final is None:
                    result = self._engine.abort(rid)
                    if inspect.isawaitable(result):
                        await result
            for task in self._pending:
                task.cancel()
            if self._pending:
                await asyncio.gather(*self._pending, return_exceptions=True)
            self._pending.clear()
            for it in self._iters:
                aclose = getattr(it, "aclose", None)
                if aclose is None:
                    continue
                try:
                    await aclose()
                except (EngineError, RuntimeError) as e:
                    logger.warning("closing an engine stream failed: %s", e)
