"""Bounded retries with exponential backoff, for calls to network tiers.

A :class:`Retry` is a small immutable object: which errors to retry, how many
times, and how long to wait between attempts. It retries only the error
types it is given — a caller passes its *transient* errors (timeouts,
overload, dropped connections) and never configuration or programming
errors — and it never sleeps longer than the backoff cap or, if set, past an
overall deadline, so it is safe on the serving path::

    retry = Retry(ExponentialBackoff(base=0.005, cap=0.1), retries=2, errors=(TransientError,))
    value = retry.call(lambda: client.get(key))

A caller with a deadline for the whole call (a ``time.monotonic()`` instant)
passes it to :meth:`Retry.call` and bounds each attempt by what is left::

    value = retry.call(lambda: client.get(key, timeout=deadline - time.monotonic()),
                       deadline=deadline)

No attempt then starts at or after the deadline, and no backoff sleeps
when the attempt after it could not start; the call ends at most one
attempt's own overrun after the deadline.

Shared by the Aerospike tier and the remote (gRPC) tier. Thread-safe: a
``Retry`` holds no per-call state, so one instance serves every thread.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from kvtier.errors import DeadlineExceededError

T = TypeVar("T")


class Backoff(Protocol):
    """How long to wait before retry number ``failures`` (1 for the first retry)."""

    def compute(self, failures: int) -> float: ...


@dataclass(frozen=True)
class NoBackoff:
    """Retry at once."""

    def compute(self, failures: int) -> float:
        return 0.0


@dataclass(frozen=True)
class ExponentialBackoff:
    """``base * factor**(failures-1)``, capped at ``cap``, with optional "equal jitter".

    Args:
        base: Seconds before the first retry.
        cap: The longest wait, in seconds.
        factor: Growth per failure.
        jitter: Fraction of the wait that is randomised: the wait is uniform in
            ``[(1 - jitter) * d, d]``. 0 makes waits deterministic; some jitter
            keeps many clients from retrying in lockstep after a shared outage.
        rand: Source of uniform ``[0, 1)`` numbers (inject for tests).
    """

    base: float = 0.005
    cap: float = 0.1
    factor: float = 2.0
    jitter: float = 0.5
    rand: Callable[[], float] = random.random

    def __post_init__(self) -> None:
        if self.base < 0 or self.cap < 0 or self.factor < 1 or not 0 <= self.jitter <= 1:
            raise ValueError(
                f"bad backoff: base={self.base} cap={self.cap} factor={self.factor} jitter={self.jitter}"
            )

    def compute(self, failures: int) -> float:
        exponent = max(0, failures - 1)
        # NOTE: cap the exponent too, so a huge failure count cannot overflow a float.
        delay = min(self.cap, self.base * self.factor ** min(exponent, 64))
        if self.jitter:
            delay *= 1.0 - self.jitter * self.rand()
        return delay


class Retry:
    """Run a call, retrying the given error types with backoff, a bounded number of times.

    Args:
        backoff: The wait before each retry.
        retries: How many times to retry after the first attempt (0: never).
        errors: Exception types worth retrying. Anything else propagates at once.
        deadline: If set, seconds from the first attempt after which no
            further retry starts (a sleep is shortened rather than run past it).
            For an absolute deadline per call, see :meth:`call`.
        min_attempt: With a per-call deadline, an attempt starts only while
            more than this many seconds are left (a shorter one could not
            finish a round trip, so it is not worth its I/O).
        sleep: Injected for tests.
        clock: Monotonic clock, injected for tests.
    """

    def __init__(
        self,
        backoff: Backoff,
        retries: int,
        errors: tuple[type[BaseException], ...],
        *,
        deadline: float | None = None,
        min_attempt: float = 0.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        if deadline is not None and deadline <= 0:
            raise ValueError(f"deadline must be > 0 seconds, got {deadline}")
        if min_attempt < 0:
            raise ValueError(f"min_attempt must be >= 0 seconds, got {min_attempt}")
        self.backoff = backoff
        self.retries = retries
        self.errors = errors
        self.deadline = deadline
        self.min_attempt = min_attempt
        self._sleep = sleep
        self._clock = clock

    def call(
        self,
        fn: Callable[[], T],
        on_retry: Callable[[BaseException, int], None] | None = None,
        *,
        deadline: float | None = None,
    ) -> T:
        """Call ``fn()`` until it returns, or raise its last error.

        Args:
            fn: The call. It is invoked at most ``retries + 1`` times. With a
                ``deadline`` it should bound itself by what is left of it.
            on_retry: Called with ``(error, failures)`` before each retry
                (for counting); it must not raise.
            deadline: An absolute instant on ``clock`` (``time.monotonic()``
                by default) that bounds the whole call: an attempt starts
                only while more than ``min_attempt`` seconds are left, and a
                backoff is not slept when the attempt after it could not
                start. ``None``: only ``retries`` (and ``self.deadline``) bound it.

        Raises:
            DeadlineExceededError: ``deadline`` left no time for the first
                attempt; ``fn`` never ran.
            Whatever ``fn`` raised last: an error not in ``errors`` at once;
            an error in ``errors`` once retries or a deadline are spent.
        """
        if deadline is not None and deadline - self._clock() <= self.min_attempt:
            raise DeadlineExceededError("the deadline passed before the first attempt")
        start = self._clock() if self.deadline is not None else 0.0
        failures = 0
        while True:
            try:
                return fn()
            except self.errors as e:
                failures += 1
                if failures > self.retries:
                    raise
                delay = self.backoff.compute(failures)
                if self.deadline is not None:
                    left = self.deadline - (self._clock() - start)
                    if left <= 0:
                        raise
                    delay = min(delay, left)
                if deadline is not None and self._clock() + delay + self.min_attempt >= deadline:
                    raise  # the next attempt could not start in time: do not wait for it
                if on_retry is not None:
                    on_retry(e, failures)
                if delay > 0:
                    self._sleep(delay)
