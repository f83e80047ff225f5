"""CircuitBreaker: closed -> open after N failures -> half-open probe -> closed, with a fake clock."""

from __future__ import annotations

import threading

import pytest

from kvtier.breaker import BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(threshold: int = 3, timeout: float = 10.0):
    clock = Clock()
    changes: list[tuple[str, str]] = []
    breaker = CircuitBreaker(
        threshold,
        timeout,
        clock=clock,
        on_state_change=lambda a, b: changes.append((a.value, b.value)),
    )
    return breaker, clock, changes


def test_opens_after_threshold_consecutive_failures() -> None:
    b, _, changes = make(threshold=3)
    for _ in range(2):
        assert b.allow()
        b.record_failure()
    assert b.state is BreakerState.CLOSED
    b.record_failure()
    assert b.state is BreakerState.OPEN
    assert not b.allow()
    assert changes == [("closed", "open")]
    assert b.opens == 1


def test_success_resets_the_count() -> None:
    b, _, _ = make(threshold=2)
    b.record_failure()
    b.record_success()
    b.record_failure()
    assert b.state is BreakerState.CLOSED
    assert b.consecutive_failures == 1


def test_half_open_lets_exactly_one_probe_through() -> None:
    b, clock, _ = make(threshold=1, timeout=10)
    b.record_failure()
    clock.now += 9.9
    assert not b.allow()
    assert b.retry_after() == pytest.approx(0.1)
    clock.now += 0.1
    assert b.allow()  # the probe
    assert b.state is BreakerState.HALF_OPEN
    assert not b.allow()
    assert not b.allow()


def test_probe_success_closes() -> None:
    b, clock, changes = make(threshold=1)
    b.record_failure()
    clock.now += 10
    assert b.allow()
    b.record_success()
    assert b.state is BreakerState.CLOSED
    assert b.allow() and b.allow()
    assert changes == [("closed", "open"), ("open", "half_open"), ("half_open", "closed")]


def test_probe_failure_reopens_for_a_new_cooldown() -> None:
    b, clock, _ = make(threshold=1, timeout=10)
    b.record_failure()
    clock.now += 10
    assert b.allow()
    b.record_failure()
    assert b.state is BreakerState.OPEN
    assert b.opens == 2
    clock.now += 9
    assert not b.allow()
    clock.now += 1
    assert b.allow()


def test_released_probe_frees_the_slot() -> None:
    b, clock, _ = make(threshold=1)
    b.record_failure()
    clock.now += 10
    assert b.allow()
    b.release()
    assert b.state is BreakerState.HALF_OPEN
    assert b.allow()  # a new probe at once


def test_silent_probe_is_given_up_after_another_timeout() -> None:
    b, clock, _ = make(threshold=1, timeout=10)
    b.record_failure()
    clock.now += 10
    assert b.allow()
    clock.now += 5
    assert not b.allow()
    clock.now += 5
    assert b.allow()


def test_late_success_does_not_close_an_open_breaker() -> None:
    b, _, _ = make(threshold=1)
    b.record_failure()
    b.record_success()  # a call that started before the breaker opened
    assert b.state is BreakerState.OPEN


def test_trip_and_reset() -> None:
    b, _, _ = make(threshold=5)
    b.trip()
    assert b.state is BreakerState.OPEN and not b.allow()
    b.reset()
    assert b.state is BreakerState.CLOSED and b.allow()


def test_concurrent_callers_get_one_probe() -> None:
    b, clock, _ = make(threshold=1)
    b.record_failure()
    clock.now += 10
    start = threading.Barrier(8)
    allowed: list[bool] = []
    lock = threading.Lock()

    def worker() -> None:
        start.wait()
        ok = b.allow()
        with lock:
            allowed.append(ok)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=5)
    assert sorted(allowed) == [False] * 7 + [True]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(0, 1.0)
    with pytest.raises(ValueError):
        CircuitBreaker(1, 0)
