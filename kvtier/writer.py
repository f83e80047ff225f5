"""Background writers: one bounded queue and one thread per slow tier.

A caller hands blocks to :meth:`BackgroundWriter.submit` and returns at once.
When the queue is full the block is dropped and counted: a slow or dead tier
never makes an inference request wait. Each tier has its own writer, so a
slow remote tier does not hold back writes to local disk.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

from kvtier.errors import KvtierError
from kvtier.metrics import StoreMetrics
from kvtier.tiers.base import Tier

log = logging.getLogger(__name__)

_STOP = object()
BACKGROUND_NICE = 10


class _Closable(Protocol):
    def close(self, timeout: float) -> None: ...


def close_at_exit(worker: _Closable, timeout: float) -> None:
    """Close ``worker`` when the interpreter exits, before daemon threads are frozen.

    A daemon thread still holding a torch tensor while the interpreter
    finalizes is killed inside a C++ destructor, and the process aborts
    ("terminate called without an active exception"). ``atexit`` callbacks
    run while such threads still run, so queued work is finished and the
    thread is joined first. Only a weak reference is held.
    """
    ref = weakref.ref(worker)

    def close() -> None:
        alive = ref()
        if alive is not None:
            alive.close(timeout)

    atexit.register(close)


def lower_thread_priority(nice: int = BACKGROUND_NICE) -> bool:
    """Make the calling thread yield the CPU to foreground work (Linux; elsewhere a no-op).

    Background encoding and writing compete for cores with the engine's
    forward pass; on a small host a busy background thread stalls every
    parallel region of the forward. A niced thread still gets the idle time.
    """
    setpriority = getattr(os, "setpriority", None)
    if setpriority is None or not hasattr(threading, "get_native_id"):
        return False
    try:
        setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError:
        return False
    return True


class BackgroundWriter:
    """Writes ``(key, block)`` pairs to one tier from a daemon thread.

    Args:
        tier: Destination.
        max_queue: Blocks that may wait; more are dropped.
        max_batch: Blocks written per ``tier.put`` call.
        metrics: Queue depth, drops, put outcomes.
        on_error: Called with each exception a put raised (for logging/tests).
    """

    def __init__(
        self,
        tier: Tier,
        *,
        max_queue: int = 1024,
        max_batch: int = 16,
        metrics: StoreMetrics | None = None,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.tier = tier
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queue)
        self._max_batch = max_batch
        self._metrics = metrics
        self._on_error = on_error
        self.dropped = 0
        self.written = 0
        self.failed = 0
        self._closed = False
        # Deletes must win over writes queued before them: a key deleted at
        # sequence number s is not written by any item submitted before s.
        self._seq = 0
        self._done_seq = 0
        self._cancelled: dict[bytes, int] = {}
        self._lock = threading.Lock()
        if metrics is not None:
            metrics.track_queue(tier.name, self._queue.qsize)
        self._thread = threading.Thread(
            target=self._run, name=f"kvtier-writer-{tier.name}", daemon=True
        )
        self._thread.start()
        close_at_exit(self, timeout=10.0)

    def submit(self, key: bytes, block: bytes, *, wait: float = 0.0) -> bool:
        """Queue one block; ``False`` (and counted) if the queue stays full for ``wait`` s, or is closed."""
        if self._closed:
            return False
        with self._lock:
            self._seq += 1
            item = (self._seq, key, block)
        try:
            if wait > 0:
                self._queue.put(item, timeout=wait)
            else:
                self._queue.put_nowait(item)
            return True
        except queue.Full:
            self.dropped += 1
            if self._metrics is not None:
                self._metrics.queue_dropped.labels(self.tier.name).inc()
            return False

    def cancel(self, keys: Sequence[bytes]) -> None:
        """Drop queued (and undo in-flight) writes of ``keys`` submitted before this call."""
        with self._lock:
            for k in keys:
                self._cancelled[k] = self._seq + 1

    def _live(self, seq: int, key: bytes) -> bool:
        cancelled_at = self._cancelled.get(key)
        return cancelled_at is None or seq >= cancelled_at

    def pending(self) -> int:
        """Blocks queued or being written."""
        return self._queue.unfinished_tasks

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far is written; ``False`` on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
        return True

    def close(self, timeout: float | None = 10.0) -> None:
        """Finish queued writes (up to ``timeout``), then stop the thread."""
        if self._closed:
            return
        self.flush(timeout)
        self._closed = True
        try:
            self._queue.put(_STOP, timeout=1.0)
        except queue.Full:
            log.warning("writer for %s: queue still full at close; abandoning it", self.tier.name)
            return
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        lower_thread_priority()
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._queue.task_done()
                return
            batch = [item]
            while len(batch) < self._max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    self._queue.task_done()
                    self._write(batch)
                    return
                batch.append(nxt)
            self._write(batch)

    def _write(self, batch: list[object]) -> None:
        entries = [b for b in batch if isinstance(b, tuple)]
        with self._lock:
            live = [(seq, k, b) for seq, k, b in entries if self._live(seq, k)]
        items: list[tuple[bytes, bytes]] = [(k, b) for _, k, b in live]
        name = self.tier.name
        if not items:
            self._finish(batch, entries)
            return
        try:
            if self._metrics is not None:
                with self._metrics.time_op(name, "put"):
                    results = self.tier.put(items)
            else:
                results = self.tier.put(items)
            ok = sum(results)
            self.written += ok
            self.failed += len(items) - ok
            if self._metrics is not None:
                self._metrics.observe_op(name, "put", "ok", ok)
                self._metrics.observe_op(name, "put", "dropped", len(items) - ok)
                self._metrics.tier_bytes.labels(name, "put").inc(
                    sum(len(b) for (_, b), r in zip(items, results, strict=True) if r)
                )
        except Exception as e:  # a tier failure, or a bug: count it and keep the writer alive
            self.failed += len(items)
            if self._metrics is not None:
                self._metrics.observe_op(name, "put", "error", len(items))
            if isinstance(e, KvtierError):
                log.debug("writer for %s: put failed: %s", name, e)
            else:
                log.exception("writer for %s: unexpected error", name)
            if self._on_error is not None:
                self._on_error(e)
        finally:
            self._undo_cancelled(live)
            self._finish(batch, entries)

    def _undo_cancelled(self, written: list[tuple[int, bytes, bytes]]) -> None:
        """A delete that arrived while these were being written must still win."""
        with self._lock:
            late = [k for seq, k, _ in written if not self._live(seq, k)]
        if late:
            try:
                self.tier.delete(late)
            except KvtierError as e:
                log.warning(
                    "writer for %s: could not undo a write deleted meanwhile: %s", self.tier.name, e
                )

    def _finish(self, batch: list[object], entries: list[tuple[int, bytes, bytes]]) -> None:
        if entries:
            with self._lock:
                # FIFO with one consumer: everything up to this sequence number is done.
                self._done_seq = max(self._done_seq, max(seq for seq, _, _ in entries))
                if self._cancelled:
                    self._cancelled = {
                        k: s for k, s in self._cancelled.items() if s > self._done_seq + 1
                    }
        for _ in batch:
            self._queue.task_done()
