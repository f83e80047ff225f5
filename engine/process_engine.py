"""``ProcessEngine``: the asyncio-facing client of an engine-core process.

The same interface as ``AsyncLLMEngine`` (``generate``, ``abort``,
``stats``, ``tokenizer`` ...), but the ``LLMEngine`` runs in a process of
its own (``core_process.py`` says why). This process keeps the tokenizer
(prompts are tokenized and validated here, before they cross), one reader
thread that turns each ``StepOutputs`` message into ``RequestOutput``s, and
hands each event loop its batch with **one** ``call_soon_threadsafe`` per
step, not one per token.

::

    generate() ─ prepare (validate) ─ AddRequest ──► cmd pipe ──► engine core
    async for out  ◄── asyncio.Queue ◄── reader thread ◄── out pipe ◄── StepOutputs

If the engine process dies, every open stream ends with ``EngineDeadError``
and ``is_running`` turns False (the server's ``/health`` then answers 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import pickle
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from kvtier.engine.config import EngineConfig
from kvtier.engine.core_process import run_engine_core
from kvtier.engine.core_protocol import (
    AbortRequest,
    AddRejected,
    AddRequest,
    Command,
    Event,
    FlushReply,
    FlushSaves,
    MetricsQuery,
    MetricsReply,
    OutputDelta,
    Ready,
    Shutdown,
    StartFailed,
    StepOutputs,
    Stopped,
)
from kvtier.engine.errors import (
    EngineConfigError,
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    ModelLoadError,
)
from kvtier.engine.kv_cache import KVCapacity
from kvtier.engine.kv_events import KvEventLog
from kvtier.engine.models.config import ModelConfig
from kvtier.engine.models.loader import load_tokenizer
from kvtier.engine.outputs import EngineStats, RequestOutput, TokenLogprob
from kvtier.engine.prompt import PreparedPrompt, prepare_prompt
from kvtier.engine.sampling_params import SamplingParams
from kvtier.engine.tokenizer import Tokenizer
from kvtier.keys import CacheNamespace

logger = logging.getLogger(__name__)

_START_ERRORS: dict[str, type[EngineError]] = {
    "ModelLoadError": ModelLoadError,
    "EngineConfigError": EngineConfigError,
}


@dataclass
class _Stream:
    """One request's consumer, and what its outputs accumulated so far."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None

    def apply(self, d: OutputDelta) -> RequestOutput:
        self.token_ids.extend(d.delta_token_ids)
        self.text += d.delta_text
        if d.new_logprobs is not None:
            self.logprobs = (self.logprobs or []) + d.new_logprobs
        return RequestOutput(
            request_id=d.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=list(self.token_ids),
            text=self.text,
            delta_token_ids=d.delta_token_ids,
            delta_text=d.delta_text,
            finished=d.finished,
            finish_reason=d.finish_reason,
            num_prompt_tokens=d.num_prompt_tokens,
            num_cached_tokens=d.num_cached_tokens,
            num_external_tokens=d.num_external_tokens,
            ttft_s=d.ttft_s,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            stop_reason=d.stop_reason,
        )


class ProcessEngine:
    """Serves many concurrent asyncio requests from an engine-core process.

    Args:
        config: The engine configuration (the model is loaded in the child).
        start_timeout_s: How long ``start`` waits for the model to load.
        flush_saves_on_finish: A request's final output is held back until the
            KV connector's saves reached its store (a prefill engine of P/D
            disaggregation: the decode engine must find the prompt's KV).
        flush_timeout_s: The longest such a flush holds a final output.
    """

    def __init__(
        self,
        config: EngineConfig,
        start_timeout_s: float = 600.0,
        *,
        flush_saves_on_finish: bool = False,
        flush_timeout_s: float = 30.0,
    ) -> None:
        self.config = config
        self.start_timeout_s = start_timeout_s
        self.flush_saves_on_finish = flush_saves_on_finish
        self.flush_timeout_s = flush_timeout_s
        self._process: BaseProcess | None = None
        self._cmds: Connection | None = None
        self._events: Connection | None = None
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._ready: Ready | None = None
        self._tokenizer: Tokenizer | None = None
        self._stats = EngineStats()
        self._adds_sent = 0
        self._adds_seen = 0
        self._metrics_waiters: dict[
            int, tuple[asyncio.AbstractEventLoop, asyncio.Future[bytes]]
        ] = {}
        self._flush_waiters: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[bool]]] = {}
        self._kv_events: KvEventLog | None = None
        self._tokens = itertools.count()
        self._dead: str | None = None
        self._stopped = False
        self._stopped_event = threading.Event()

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> ProcessEngine:
        """Spawns the engine process and waits until its model is loaded (idempotent).

        Raises:
            ModelLoadError, EngineConfigError, EngineError: if the engine cannot start.
        """
        if self._stopped:
            raise EngineError("engine was shut down")
        if self._process is not None:
            return self
        ctx = mp.get_context("spawn")
        cmd_recv, cmd_send = ctx.Pipe(duplex=False)
        ev_recv, ev_send = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=run_engine_core,
            args=(self.config, cmd_recv, ev_send),
            name="kvtier-engine-core",
            daemon=True,
        )
        proc.start()
        cmd_recv.close()
        ev_send.close()
        self._process, self._cmds, self._events = proc, cmd_send, ev_recv
        try:
            # the tokenizer loads here while the child loads the weights
            self._tokenizer = load_tokenizer(self.config.model)
            first = self._wait_first_event()
        except BaseException:
            self._kill()
            raise
        if isinstance(first, StartFailed):
            self._kill()
            raise _START_ERRORS.get(first.kind, EngineError)(first.message)
        self._ready = first
        if first.kv_namespace is not None:
            self._kv_events = KvEventLog()
        self._reader = threading.Thread(
            target=self._read_loop, name="kvtier-engine-io", daemon=True
        )
        self._reader.start()
        return self

    def _wait_first_event(self) -> Ready | StartFailed:
        assert self._events is not None and self._process is not None
        deadline = time.monotonic() + self.start_timeout_s
        while not self._events.poll(0.2):
            if not self._process.is_alive():
                raise EngineError(
                    f"the engine process exited during start-up (exit code {self._process.exitcode})"
                )
            if time.monotonic() > deadline:
                raise EngineError(f"the engine did not start within {self.start_timeout_s:.0f} s")
        try:
            event = pickle.loads(self._events.recv_bytes())
        except EOFError:
            raise EngineError("the engine process exited during start-up") from None
        if not isinstance(event, Ready | StartFailed):
            raise EngineError(f"unexpected first message from the engine: {event!r}")
        return event

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops the engine process; unfinished streams end with an abort output.

        The engine aborts what runs and shuts its connector down (flushing
        pending writes) before it exits.
        """
        if self._stopped:
            return
        self._stopped = True
        if self._process is None:
            return
        with contextlib.suppress(OSError, EngineError):
            self._send(Shutdown())
        self._stopped_event.wait(timeout)
        self._process.join(timeout)
        self._kill()
        if self._reader is not None:
            self._reader.join(timeout)

    def _kill(self) -> None:
        proc = self._process
        if proc is not None and proc.is_alive():
            proc.terminate()
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        if self._cmds is not None:
            self._cmds.close()

    @property
    def is_running(self) -> bool:
        """True while the engine process runs its loop."""
        return (
            self._ready is not None
            and self._dead is None
            and not self._stopped_event.is_set()
            and self._process is not None
            and self._process.is_alive()
        )

    @property
    def pid(self) -> int | None:
        """The engine process's PID (None before start)."""
        return self._process.pid if self._process is not None else None

    # ---- properties ------------------------------------------------------------------

    def _info(self) -> Ready:
        if self._ready is None:
            raise EngineError("the engine is not started (call start())")
        return self._ready

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (loaded in this process)."""
        if self._tokenizer is None:
            raise EngineError("the engine is not started (call start())")
        return self._tokenizer

    @property
    def model_config(self) -> ModelConfig:
        """The model's hyper-parameters."""
        return self._info().model_config

    @property
    def model_id(self) -> str:
        """Readable model name."""
        return self._info().model_id

    @property
    def fingerprint(self) -> str:
        """Hex digest of the model's weights."""
        return self._info().fingerprint

    @property
    def max_model_len(self) -> int:
        """Longest sequence the engine accepts."""
        return self._info().max_model_len

    @property
    def capacity(self) -> KVCapacity | None:
        """What the engine's KV cache holds (None from an engine that did not say)."""
        return self._info().capacity

    @property
    def num_threads(self) -> int:
        """Torch threads of the engine process."""
        return self._info().num_threads

    @property
    def kv_events(self) -> KvEventLog | None:
        """The engine's KV events (None before start or when the engine publishes none)."""
        return self._kv_events

    @property
    def kv_namespace(self) -> CacheNamespace | None:
        """The namespace of the keys in ``kv_events``."""
        return self._info().kv_namespace

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self._info().block_size

    async def flush_saves(self, timeout_s: float = 30.0) -> bool:
        """Waits until the KV connector's queued saves have reached its store's tiers.

        Answered between two engine steps (the engine waits for the flush).
        True when everything was written (or there is nothing to flush);
        False on a timeout, a failed flush or an engine that is not running.
        """
        if not self.is_running:
            return False
        loop = asyncio.get_running_loop()
        token = next(self._tokens)
        fut: asyncio.Future[bool] = loop.create_future()
        with self._lock:
            self._flush_waiters[token] = (loop, fut)
        try:
            self._send(FlushSaves(token, timeout_s))
            return await asyncio.wait_for(fut, timeout_s + 10.0)
        except (TimeoutError, EngineError, OSError):
            return False
        finally:
            with self._lock:
                self._flush_waiters.pop(token, None)

    def stats(self) -> EngineStats:
        """The statistics as of the engine's last step (never blocks).

        Requests sent but not yet picked up by the engine count as waiting.
        """
        with self._lock:
            pending = self._adds_sent - self._adds_seen
            snap = self._stats
        return replace(snap, num_waiting=snap.num_waiting + pending) if pending else snap

    async def metrics_text(self, timeout_s: float = 10.0) -> bytes:
        """Prometheus text of the engine process's metrics (engine and connector).

        Answered between two engine steps. Empty when the engine is not running.
        """
        if not self.is_running:
            return b""
        loop = asyncio.get_running_loop()
        token = next(self._tokens)
        fut: asyncio.Future[bytes] = loop.create_future()
        with self._lock:
            self._metrics_waiters[token] = (loop, fut)
        try:
            self._send(MetricsQuery(token))
            return await asyncio.wait_for(fut, timeout_s)
        except (TimeoutError, EngineError, OSError):
            return b""
        finally:
            with self._lock:
                self._metrics_waiters.pop(token, None)

    # ---- requests --------------------------------------------------------------------

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
        info = self._info()
        return prepare_prompt(
            self.tokenizer,
            info.model_config.vocab_size,
            info.max_model_len,
            prompt,
            params,
            request_id,
        )

    async def generate(
        self,
        prompt: str | Sequence[int] | PreparedPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs until it finishes.

        Leaving the ``async for`` early or cancelling the consumer aborts the
        request and frees its blocks.

        Raises:
            InvalidRequestError: for a bad prompt, parameters or duplicate id
                (at the first iteration, before any output).
            EngineDeadError: if the engine process died.
        """
        if self._dead is not None:
            raise EngineDeadError(f"engine process died: {self._dead}")
        if self._stopped:
            raise EngineError("engine was shut down")
        prepared = (
            prompt
            if isinstance(prompt, PreparedPrompt)
            else self.prepare(prompt, params, request_id)
        )
        rid = prepared.request_id
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), prepared.prompt_token_ids)
        with self._lock:
            if rid in self._streams:
                raise InvalidRequestError(f"request id {rid!r} is already in use", "request_id")
            self._streams[rid] = stream
            self._adds_sent += 1
        finished = False
        try:
            self._send(AddRequest(prepared, time.monotonic()))
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                if finished and self.flush_saves_on_finish and item.finish_reason != "abort":
                    # a failed flush is a miss for the next engine, never an error here
                    await self.flush_saves(self.flush_timeout_s)
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(rid, None)
            if not finished:
                with contextlib.suppress(OSError, EngineError):
                    self._send(AbortRequest(rid))

    def abort(self, request_id: str) -> None:
        """Aborts a request (its stream ends with ``finish_reason == "abort"``)."""
        with contextlib.suppress(OSError, EngineError):
            self._send(AbortRequest(request_id))

    def _send(self, cmd: Command) -> None:
        if self._cmds is None or self._dead is not None:
            raise EngineDeadError(f"the engine is not running: {self._dead or 'not started'}")
        data = pickle.dumps(cmd, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._cmds.send_bytes(data)

    # ---- the reader thread -------------------------------------------------------------

    def _read_loop(self) -> None:
        assert self._events is not None
        error: str | None = None
        try:
            while True:
                event: Event = pickle.loads(self._events.recv_bytes())
                if isinstance(event, StepOutputs):
                    self._on_step(event)
                elif isinstance(event, AddRejected):
                    self._fail(event.request_id, InvalidRequestError(event.message, event.field))
                elif isinstance(event, MetricsReply):
                    self._on_metrics(event)
                elif isinstance(event, FlushReply):
                    self._on_flush(event)
                elif isinstance(event, Stopped):
                    error = event.error
                    break
        except (EOFError, OSError):
            error = "the engine process exited"
        finally:
            self._stopped_event.set()
            if error is not None and not self._stopped:
                logger.error("engine process stopped: %s", error)
            self._end_all(error)

    def _on_step(self, event: StepOutputs) -> None:
        if self._kv_events is not None and event.kv_events:
            self._kv_events.append(event.kv_events)
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        with self._lock:
            self._stats = event.stats
            self._adds_seen = event.adds_seen
            for d in event.outputs:
                stream = self._streams.get(d.request_id)
                if stream is not None:
                    batches.setdefault(stream.loop, []).append((stream, stream.apply(d)))
        for loop, items in batches.items():
            self._call(loop, items)

    def _fail(self, request_id: str, error: BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            self._call(stream.loop, [(stream, error)])

    def _on_metrics(self, event: MetricsReply) -> None:
        with self._lock:
            waiter = self._metrics_waiters.get(event.token)
        if waiter is not None:
            loop, fut = waiter
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, fut, event.text)

    def _on_flush(self, event: FlushReply) -> None:
        with self._lock:
            waiter = self._flush_waiters.get(event.token)
        if waiter is not None:
            loop, fut = waiter
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve_flag, fut, event.ok)

    def _end_all(self, error: str | None) -> None:
        """After the loop ended: streams still open get an error (the engine is gone)."""
        if error is not None:
            self._dead = error
        with self._lock:
            streams = list(self._streams.values())
            waiters = list(self._metrics_waiters.values())
            flushes = list(self._flush_waiters.values())
        dead = EngineDeadError(f"engine process stopped: {error or 'shut down'}")
        for stream in streams:
            self._call(stream.loop, [(stream, dead)])
        for loop, fut in waiters:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, fut, b"")
        for loop, flag in flushes:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve_flag, flag, False)

    @staticmethod
    def _call(
        loop: asyncio.AbstractEventLoop, items: list[tuple[_Stream, RequestOutput | BaseException]]
    ) -> None:
        with contextlib.suppress(RuntimeError):  # that loop is closed: nobody is listening
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


def _resolve(fut: asyncio.Future[bytes], value: bytes) -> None:
    if not fut.done():
        fut.set_result(value)


def _resolve_flag(fut: asyncio.Future[bool], value: bool) -> None:
    if not fut.done():
        fut.set_result(value)
