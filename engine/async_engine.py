"""``AsyncLLMEngine``: an ``LLMEngine`` driven by one background thread, for asyncio callers.

Threading model::

    asyncio callers                       engine thread (owns LLMEngine)
    ---------------                       ------------------------------
    generate() --prepare (validate)--+
               --("add", req)------->| inbox (queue.Queue) --> add_prepared / abort
    abort()    --("abort", id)------>|                          step() while work exists,
                                     |                          else block on inbox.get()
    async for out in stream  <-------+-- loop.call_soon_threadsafe(queue.put_nowait, out)

Only the engine thread touches the ``LLMEngine`` after start; callers talk
to it through the inbox and read outputs from their own ``asyncio.Queue``.
When idle the thread blocks on the inbox (no busy spin).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

from kvtier.engine.config import EngineConfig
from kvtier.engine.connector import KVConnector
from kvtier.engine.errors import EngineDeadError, EngineError, InvalidRequestError
from kvtier.engine.llm_engine import LLMEngine, PreparedPrompt
from kvtier.engine.metrics import EngineMetrics
from kvtier.engine.models.config import ModelConfig
from kvtier.engine.outputs import EngineStats, RequestOutput
from kvtier.engine.sampling_params import SamplingParams
from kvtier.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


@dataclass(frozen=True)
class _Add:
    prepared: PreparedPrompt
    arrival_time: float


@dataclass(frozen=True)
class _Abort:
    request_id: str


class _Stop:
    pass


class AsyncLLMEngine:
    """Serves many concurrent asyncio requests from one engine thread.

    Args:
        config: The engine configuration (the model is loaded in the constructor).
        metrics: Optional Prometheus metrics.
        connector: Optional KV connector instance.
    """

    def __init__(
        self,
        config: EngineConfig,
        metrics: EngineMetrics | None = None,
        connector: KVConnector | None = None,
    ) -> None:
        self.engine = LLMEngine(config, metrics, connector)
        self._inbox: queue.Queue[_Add | _Abort | _Stop] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._dead: BaseException | None = None
        self._stats = self.engine.stats()
        # Requests handed to the inbox but not yet in a stats snapshot: counted
        # as waiting so that stats() never reports idle while work is queued.
        self._pending_adds = 0
        self._picked_up = 0  # engine thread only
        self._pending_lock = threading.Lock()

    # ---- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Starts the engine thread (idempotent)."""
        if self._stopped:
            raise EngineError("engine was shut down")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvtier-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops the engine thread; unfinished streams end with an abort output."""
        if self._stopped:
            return
        self._stopped = True
        if self._thread is not None:
            self._inbox.put(_Stop())
            self._thread.join(timeout)
        self.engine.shutdown()

    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    # ---- properties ----------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
        return self.engine.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        """The model's hyper-parameters."""
        return self.engine.model_config

    @property
    def model_id(self) -> str:
        """Readable model name."""
        return self.engine.model_id

    @property
    def fingerprint(self) -> str:
        """Hex digest of the model's weights."""
        return self.engine.fingerprint

    @property
    def max_model_len(self) -> int:
        """Longest sequence the engine accepts."""
        return self.engine.max_model_len

    def stats(self) -> EngineStats:
        """The statistics as of the end of the last engine step (never blocks).

        Requests submitted but not yet picked up by the engine thread are
        counted in ``num_waiting``.
        """
        with self._pending_lock:
            pending = self._pending_adds
        snap = self._stats
        return replace(snap, num_waiting=snap.num_waiting + pending) if pending else snap

    # ---- requests ------------------------------------------------------------------

    def prepare(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> PreparedPrompt:
        """Validates and tokenizes without queueing (lets a server reject early).

        Raises:
            InvalidRequestError: for a bad prompt or parameters.
        """
        return self.engine.prepare(prompt, params, request_id)

    async def generate(
        self,
        prompt: str | Sequence[int] | PreparedPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs until it finishes.

        Starts the engine thread if needed. Leaving the ``async for`` early or
        cancelling the consuming task aborts the request and frees its blocks.

        Raises:
            InvalidRequestError: for a bad prompt, parameters or duplicate id
                (at the first iteration, before any output).
            EngineDeadError: if the engine thread died.
        """
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        if self._stopped:
            raise EngineError("engine was shut down")
        self.start()
        prepared = (
            prompt
            if isinstance(prompt, PreparedPrompt)
            else self.engine.prepare(prompt, params, request_id)
        )
        rid = prepared.request_id
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._streams_lock:
            if rid in self._streams:
                raise InvalidRequestError(f"request id {rid!r} is already in use", "request_id")
            self._streams[rid] = stream
        with self._pending_lock:
            self._pending_adds += 1
        self._inbox.put(_Add(prepared, time.monotonic()))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._streams_lock:
                self._streams.pop(rid, None)
            if not finished:
                self._inbox.put(_Abort(rid))

    def abort(self, request_id: str) -> None:
        """Aborts a request (its stream ends with ``finish_reason == "abort"``)."""
        self._inbox.put(_Abort(request_id))

    # ---- the engine thread --------------------------------------------------------------

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        with self._streams_lock:
            stream = self._streams.get(rid)
        if stream is None:
            return
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            with self._streams_lock:
                self._streams.pop(rid, None)

    def _handle(self, cmd: _Add | _Abort | _Stop) -> bool:
        """Applies one inbox command; returns False on stop."""
        if isinstance(cmd, _Stop):
            return False
        if isinstance(cmd, _Add):
            self._picked_up += 1
            try:
                self.engine.add_prepared(cmd.prepared, cmd.arrival_time)
            except InvalidRequestError as e:
                self._deliver(cmd.prepared.request_id, e)
        else:
            out = self.engine.abort(cmd.request_id)
            if out is not None:
                self._deliver(cmd.request_id, out)
        return True

    def _run(self) -> None:
        engine = self.engine
        try:
            running = True
            while running:
                if not engine.has_unfinished():
                    running = self._handle(self._inbox.get())  # idle: block, no spin
                while running:
                    try:
                        cmd = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    running = self._handle(cmd)
                if running and engine.has_unfinished():
                    for out in engine.step():
                        self._deliver(out.request_id, out)
                self._publish_stats()
            self._abort_all()
        except Exception as e:  # the loop must not die silently: fail every stream loudly
            logger.exception("engine loop died")
            self._dead = e
            dead = EngineDeadError(f"engine loop died: {e!r}")
            with self._streams_lock:
                rids = list(self._streams)
            for rid in rids:
                self._deliver(rid, dead)

    def _publish_stats(self) -> None:
        """Takes a stats snapshot; adds picked up since the last one leave the pending count."""
        self._stats = self.engine.stats()
        with self._pending_lock:
            self._pending_adds -= self._picked_up
        self._picked_up = 0

    def _abort_all(self) -> None:
        with self._streams_lock:
            rids = list(self._streams)
        for rid in rids:
            out = self.engine.abort(rid)
            if out is not None:
                self._deliver(rid, out)
        self._publish_stats()
