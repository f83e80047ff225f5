"""A thread-safe circuit breaker: stop calling a dependency that keeps failing.

States and transitions::

    CLOSED ──(failure_threshold consecutive failures)──► OPEN
      ▲                                                   │
      │ probe succeeds                     reset_timeout elapses,
      │                                    next allow() takes the probe
      └──────────────── HALF_OPEN ◄───────────────────────┘
                           │ probe fails
                           └──────────► OPEN (cool-down restarts)

* **closed**: every call is allowed; a success resets the failure count.
* **open**: :meth:`CircuitBreaker.allow` returns ``False`` without any I/O,
  so the caller can fail fast (the store then serves from the tiers above).
* **half-open**: exactly one call — the probe — is let through; the others
  keep failing fast until the probe reports. A probe that never reports (a
  caller bug) is given up on after another ``reset_timeout``, and a new probe
  is allowed.

Usage (the caller decides what counts as a failure, e.g. transient network
errors only, never "record not found")::

    if not breaker.allow():
        raise TierUnavailableError(...)
    try:
        result = call()
    except TransientError:
        breaker.record_failure()
        raise
    except BaseException:
        breaker.release()       # no verdict on the dependency's health
        raise
    breaker.record_success()

Shared by the Aerospike tier and the remote (gRPC) tier. All methods are
thread-safe. The clock is injectable so tests need not sleep.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable


class BreakerState(enum.Enum):
    """Where the breaker stands."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


StateListener = Callable[[BreakerState, BreakerState], None]
"""Called with ``(old, new)`` on every transition, under the breaker's lock:
it must be quick and must not call back into the breaker."""


class CircuitBreaker:
    """Counts consecutive failures and opens for a cool-down after too many.

    Args:
        failure_threshold: Consecutive failures that open the breaker (>= 1).
        reset_timeout: Cool-down in seconds before a probe is allowed (> 0).
        clock: Monotonic clock in seconds (inject a fake one in tests).
        on_state_change: Optional :data:`StateListener` (metrics, logs).
    """

    def __init__(
        self,
        failure_threshold: int = 5,
        reset_timeout: float = 5.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_state_change: StateListener | None = None,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if reset_timeout <= 0:
            raise ValueError(f"reset_timeout must be > 0 seconds, got {reset_timeout}")
        self.failure_threshold = failure_threshold
        self.reset_timeout = reset_timeout
        self._clock = clock
        self._listener = on_state_change
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probe_started: float | None = None
        self._opens = 0

    @property
    def state(self) -> BreakerState:
        """The current state (an open breaker whose cool-down has passed still reads OPEN
        until the next :meth:`allow` takes the probe)."""
        with self._lock:
            return self._state

    @property
    def consecutive_failures(self) -> int:
        with self._lock:
            return self._failures

    @property
    def opens(self) -> int:
        """How many times the breaker has opened (including re-opens after a failed probe)."""
        with self._lock:
            return self._opens

    def retry_after(self) -> float:
        """Seconds until a probe may go through (0 when calls are allowed now)."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return 0.0
            if self._state is BreakerState.OPEN:
                return max(0.0, self._opened_at + self.reset_timeout - self._clock())
            assert self._probe_started is not None
            return max(0.0, self._probe_started + self.reset_timeout - self._clock())

    def allow(self) -> bool:
        """Whether a call may go ahead now. Never blocks, never does I/O.

        A ``True`` from an open breaker whose cool-down has passed makes the
        caller the probe: it must report with :meth:`record_success`,
        :meth:`record_failure` or :meth:`release`.
        """
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            now = self._clock()
            if self._state is BreakerState.OPEN:
                if now - self._opened_at < self.reset_timeout:
                    return False
                self._set(BreakerState.HALF_OPEN)
                self._probe_started = now
                return True
            # HALF_OPEN: one probe at a time, unless the probe went silent.
            assert self._probe_started is not None
            if now - self._probe_started >= self.reset_timeout:
                self._probe_started = now
                return True
            return False

    def record_success(self) -> None:
        """The call reached a healthy dependency: close (from half-open) and reset the count."""
        with self._lock:
            if self._state is BreakerState.OPEN:
                return  # a call that started before the breaker opened; keep the cool-down
            self._failures = 0
            self._probe_started = None
            if self._state is BreakerState.HALF_OPEN:
                self._set(BreakerState.CLOSED)

    def record_failure(self) -> None:
        """The call failed in a way that says the dependency is unhealthy."""
        with self._lock:
            now = self._clock()
            if self._state is BreakerState.HALF_OPEN:
                self._open(now)
                return
            if self._state is BreakerState.OPEN:
                return
            self._failures += 1
            if self._failures >= self.failure_threshold:
                self._open(now)

    def release(self) -> None:
        """The call ended without a verdict (e.g. a caller-side error): free the probe slot."""
        with self._lock:
            if self._state is BreakerState.HALF_OPEN:
                self._probe_started = self._clock() - self.reset_timeout  # next allow() may probe

    def trip(self) -> None:
        """Open now, whatever the count (e.g. the first connection attempt failed)."""
        with self._lock:
            if self._state is not BreakerState.OPEN:
                self._open(self._clock())

    def reset(self) -> None:
        """Close and forget all failures."""
        with self._lock:
            self._failures = 0
            self._probe_started = None
            if self._state is not BreakerState.CLOSED:
                self._set(BreakerState.CLOSED)

    def _open(self, now: float) -> None:
        self._opened_at = now
        self._probe_started = None
        self._failures = max(self._failures, self.failure_threshold)
        self._opens += 1
        self._set(BreakerState.OPEN)

    def _set(self, new: BreakerState) -> None:
        old, self._state = self._state, new
        if self._listener is not None and old is not new:
            self._listener(old, new)
