"""A bounded queue drained by one background thread: what the saver and the verifier share.

The step thread offers items and never waits: a full queue refuses the item
(the caller counts the drop). The thread runs niced, so it yields to the
forward pass; an item that fails is logged and counted by the subclass, never
the end of the thread. ``close`` (also run at interpreter exit) drains what is
queued up to a deadline, then stops the thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Generic, TypeVar

from kvtier.errors import KvtierError
from kvtier.writer import close_at_exit, lower_thread_priority

log = logging.getLogger(__name__)

T = TypeVar("T")
_STOP = object()


class QueueWorker(Generic[T]):
    """Runs ``_handle`` on each offered item, in order, on a daemon thread.

    Subclasses set their own attributes first, then call ``__init__`` (it starts
    the thread), and implement ``_handle`` and ``_failed``.

    Args:
        name: The thread's name (also in log lines).
        max_queue: Items that may wait; ``offer`` refuses more.
    """

    def __init__(self, name: str, max_queue: int) -> None:
        self._name = name
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queue)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        close_at_exit(self, timeout=30.0)

    def _offer(self, item: T) -> bool:
        """Queues ``item``; ``False`` (nothing queued) when the queue is full."""
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            return False

    def _drain(self, deadline: float) -> bool:
        """Waits until every queued item is handled; ``False`` at ``deadline`` (monotonic)."""
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
        return True

    def flush(self, timeout: float) -> bool:
        """Waits until every queued item is handled; ``False`` on timeout."""
        return self._drain(time.monotonic() + timeout)

    def close(self, timeout: float) -> None:
        """Handles what is queued (up to ``timeout``), then stops the thread."""
        if self._closed:
            return
        self._closed = True
        self.flush(timeout)
        try:
            self._queue.put(_STOP, timeout=1.0)
        except queue.Full:
            log.warning("%s: queue still full at shutdown; abandoning it", self._name)
            return
        self._thread.join(timeout=5.0)

    def _handle(self, item: T) -> None:
        raise NotImplementedError

    def _failed(self, item: T, error: Exception) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        lower_thread_priority()  # background work must not slow the forward pass down
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                self._handle(item)  # type: ignore[arg-type]  # only T and _STOP are queued
            except (KvtierError, ValueError, RuntimeError) as e:  # the item is lost, not the thread
                self._failed(item, e)  # type: ignore[arg-type]
            finally:
                self._queue.task_done()
