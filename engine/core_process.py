"""The engine-core process: one ``LLMEngine`` stepping in a process of its own.

NOTE: why a process. When the HTTP server, tokenization and the engine loop
share one interpreter, every torch op the step thread issues has to win the
GIL back from the event loop, and every SSE chunk the loop renders waits for
the step thread: served decode steps measured several times slower than the
same steps offline (docs/engine.md, "Serving"). vLLM and SGLang run their
engine core in its own process for the same reason. Here the API process
tokenizes, validates, renders and streams; this process only schedules,
runs the model, detokenizes (incrementally, to apply stop strings) and sends
one message per step.

The loop::

    idle  ── block on the command pipe (no spin)
    busy  ── drain commands (add / abort / metrics) ── step() ── send StepOutputs

It ends on ``Shutdown`` or when the API process goes away (its pipe closes):
either way running requests are aborted and the connector is shut down so
that it flushes its pending writes.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import pickle
import time
from multiprocessing.connection import Connection

from prometheus_client import CollectorRegistry, generate_latest

from kvtier.engine.config import EngineConfig
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
from kvtier.engine.errors import InvalidRequestError
from kvtier.engine.kv_events import KvEventRecorder, attach_recorder
from kvtier.engine.llm_engine import LLMEngine
from kvtier.engine.metrics import EngineMetrics
from kvtier.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)


def _send(conn: Connection, event: Event) -> None:
    conn.send_bytes(pickle.dumps(event, protocol=pickle.HIGHEST_PROTOCOL))


class _Core:
    """The loop's state: the engine, its registries and the pipes."""

    def __init__(self, engine: LLMEngine, registry: CollectorRegistry, cmds: Connection,
                 events: Connection, recorder: KvEventRecorder | None = None) -> None:  # fmt: skip
        self.engine = engine
        self.recorder = recorder
        self.registry = registry
        self.cmds = cmds
        self.events = events
        self.adds_seen = 0
        self.stopping = False
        self.pending: list[RequestOutput] = []  # abort outputs not yet sent

    def metrics_text(self) -> bytes:
        text = generate_latest(self.registry)
        connector_registry = getattr(
            getattr(self.engine.connector, "metrics", None), "registry", None
        )
        if isinstance(connector_registry, CollectorRegistry):
            text += generate_latest(connector_registry)
        return text

    def handle(self, cmd: Command) -> None:
        engine = self.engine
        if isinstance(cmd, AddRequest):
            self.adds_seen += 1
            try:
                engine.add_prepared(cmd.prepared, cmd.arrival_time)
            except InvalidRequestError as e:
                _send(self.events, AddRejected(cmd.prepared.request_id, str(e), e.field))
        elif isinstance(cmd, AbortRequest):
            out = engine.abort(cmd.request_id)
            if out is not None:
                self.pending.append(out)
        elif isinstance(cmd, MetricsQuery):
            _send(self.events, MetricsReply(cmd.token, self.metrics_text()))
        elif isinstance(cmd, FlushSaves):
            _send(self.events, FlushReply(cmd.token, self.flush_saves(cmd.timeout_s)))
        elif isinstance(cmd, Shutdown):
            self.stopping = True

    def flush_saves(self, timeout_s: float) -> bool:
        """Waits for the connector's queued saves (a prefill engine answers after them).

        NOTE: blocking the loop is deliberate: while it waits no new saves are
        queued, so the flush ends; a failed flush is a later miss, never an error.
        """
        flush = getattr(self.engine.connector, "flush", None)
        if flush is None:
            return True
        try:
            return bool(flush(timeout_s))
        except Exception:  # a cache failure never fails a request
            logger.exception("connector flush failed")
            return False

    def drain(self, block: bool) -> None:
        """Applies every queued command; with ``block``, waits for the first one.

        Raises:
            EOFError: when the API process closed its end (it exited).
        """
        if block and not self.cmds.poll(None):
            return
        while not self.stopping and self.cmds.poll(0):
            self.handle(pickle.loads(self.cmds.recv_bytes()))

    def publish(self, outputs: list[RequestOutput]) -> None:
        outs = self.pending + outputs
        self.pending = []
        deltas = [OutputDelta.of(o) for o in outs]
        kv_events = self.recorder.drain() if self.recorder is not None else []
        _send(self.events, StepOutputs(deltas, self.engine.stats(), self.adds_seen, kv_events))

    def run(self) -> None:
        engine = self.engine
        metrics = engine.metrics
        seen = -1
        while not self.stopping:
            idle = not engine.has_unfinished()
            t0 = time.perf_counter()
            self.drain(block=idle)
            if self.stopping:
                break
            if engine.has_unfinished():
                if metrics is not None and not idle:
                    metrics.observe_core("commands", time.perf_counter() - t0)
                outputs = engine.step()
                t1 = time.perf_counter()
                self.publish(outputs)
                if metrics is not None:
                    metrics.observe_core("publish", time.perf_counter() - t1)
            elif self.pending or seen != self.adds_seen:
                self.publish([])  # aborts and rejected adds while idle: fresh stats
            seen = self.adds_seen

    def abort_all(self) -> None:
        sched = self.engine.scheduler
        loading = [req for req, _ in sched.loading.values()]
        for req in [*sched.running, *sched.waiting, *loading]:
            out = self.engine.abort(req.request_id)
            if out is not None:
                self.pending.append(out)


def run_engine_core(config: EngineConfig, cmds: Connection, events: Connection) -> None:
    """The engine-core process's entry point (``multiprocessing`` spawn target).

    Loads the model, reports ``Ready`` (or ``StartFailed``) and runs the loop
    until ``Shutdown`` or until the API process goes away.
    """
    logging.basicConfig(level=os.environ.get("KVTIER_ENGINE_LOG_LEVEL", "WARNING"))
    registry = CollectorRegistry()
    try:
        engine = LLMEngine(config, EngineMetrics(registry))
    except Exception as e:  # reported to the API process, which raises it at start()
        _send(events, StartFailed(type(e).__name__, str(e)))
        return
    import torch

    recorder: KvEventRecorder | None = None
    try:
        recorder = attach_recorder(engine)
    except ValueError as e:  # the engine serves without KV events
        logger.warning("no KV events: %s", e)
    # NOTE: the model and the cache are long-lived; freezing them keeps the
    # cyclic GC from walking them on every collection during serving.
    gc.collect()
    gc.freeze()
    _send(
        events,
        Ready(
            model_id=engine.model_id,
            fingerprint=engine.fingerprint,
            max_model_len=engine.max_model_len,
            model_config=engine.model_config,
            num_threads=torch.get_num_threads(),
            pid=os.getpid(),
            kv_namespace=recorder.namespace if recorder is not None else None,
            block_size=engine.block_manager.block_size,
            capacity=engine.capacity,
        ),
    )
    core = _Core(engine, registry, cmds, events, recorder)
    error: str | None = None
    try:
        core.run()
    except EOFError:
        pass  # the API process is gone: nobody to answer, but flush the connector
    except Exception as e:
        logger.exception("engine core loop died")
        error = repr(e)
    try:
        core.abort_all()
        if core.pending and error is None:
            core.publish([])
    except (OSError, EOFError):
        pass
    finally:
        engine.shutdown()
    with contextlib.suppress(OSError):
        _send(events, Stopped(error))
