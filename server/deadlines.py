"""Deadlines the server enforces on gRPC streams: an idle one and a total one per call.

A client decides how long its own calls may take; a hostile or stuck client
decides "forever". gRPC's synchronous server holds one thread per streaming
call, and a Put stream that stops sending (or a Get stream whose reader
stops reading) would hold it, and the bytes its block reserved, for good.
A :class:`Reaper` thread watches every such stream and cancels it when it
made no progress (a frame in or out) for ``stream_idle_timeout_s``, or
when it has run for ``call_timeout_s``; cancelling ends the handler's
request iterator (or its next write), so the thread and its reservations
come back. The data plane enforces the same two bounds with socket
deadlines (:mod:`kvtier.server.dataplane_session`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

_TICK_S = 0.25


class Watch:
    """One watched call: :meth:`touch` on every frame, :meth:`close` at its end."""

    def __init__(self, reaper: Reaper, cancel: Callable[[], None], idle_s: float, total_s: float):
        now = time.monotonic()
        self._reaper = reaper
        self._cancel = cancel
        self._idle_s = idle_s
        self._end = now + total_s
        self.last = now
        self.reason: str | None = None
        """Why the server cancelled the call (``idle`` or ``deadline``); ``None``: it did not."""

    def touch(self) -> None:
        """The call made progress."""
        self.last = time.monotonic()

    def close(self) -> None:
        """The call ended; stop watching it."""
        self._reaper.forget(self)

    def _expired(self, now: float) -> str | None:
        if now >= self._end:
            return "deadline"
        if now - self.last >= self._idle_s:
            return "idle"
        return None


class Reaper:
    """Cancels watched calls that idle or overrun (see the module docstring). Thread-safe.

    Args:
        on_cancel: Told the reason of each cancellation (for metrics).
    """

    def __init__(self, on_cancel: Callable[[str], None] | None = None) -> None:
        self._watches: set[Watch] = set()
        self._lock = threading.Lock()
        self._on_cancel = on_cancel
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-reaper", daemon=True)
        self._thread.start()

    def watch(self, cancel: Callable[[], None], *, idle_s: float, total_s: float) -> Watch:
        """Watch a call; ``cancel`` ends it (called on the reaper's thread)."""
        w = Watch(self, cancel, idle_s, total_s)
        with self._lock:
            self._watches.add(w)
        return w

    def forget(self, w: Watch) -> None:
        with self._lock:
            self._watches.discard(w)

    def _run(self) -> None:
        while not self._stop.wait(_TICK_S):
            now = time.monotonic()
            with self._lock:
                due = [(w, r) for w in self._watches if (r := w._expired(now)) is not None]
                for w, _ in due:
                    self._watches.discard(w)
            for w, reason in due:
                w.reason = reason
                if self._on_cancel is not None:
                    self._on_cancel(reason)
                log.info("cancelling a call: %s", "no progress" if reason == "idle" else reason)
                try:
                    w._cancel()
                except Exception:  # a call that ended meanwhile; nothing to cancel
                    log.debug("cancelling a call failed", exc_info=True)

    def close(self) -> None:
        """Stop watching (calls in flight keep running)."""
        self._stop.set()
        self._thread.join(timeout=5)
