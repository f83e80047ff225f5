"""Retry: bounded attempts, only the listed errors, capped exponential backoff, deadline."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError, DeadlineExceededError, TransientError
from kvtier.retry import ExponentialBackoff, NoBackoff, Retry


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def flaky(failures: list[BaseException], value: str = "ok"):
    calls = []

    def fn() -> str:
        calls.append(1)
        if failures:
            raise failures.pop(0)
        return value

    return fn, calls


def test_retries_listed_errors_until_success() -> None:
    t = FakeTime()
    retry = Retry(
        ExponentialBackoff(base=0.01, cap=1, jitter=0), 3, (TransientError,), sleep=t.sleep
    )
    fn, calls = flaky([TransientError("a"), TransientError("b")])
    assert retry.call(fn) == "ok"
    assert len(calls) == 3
    assert t.sleeps == [0.01, 0.02]


def test_gives_up_after_retries_and_raises_the_last_error() -> None:
    t = FakeTime()
    retry = Retry(NoBackoff(), 2, (TransientError,), sleep=t.sleep)
    fn, calls = flaky(
        [TransientError("1"), TransientError("2"), TransientError("3"), TransientError("4")]
    )
    with pytest.raises(TransientError, match="3"):
        retry.call(fn)
    assert len(calls) == 3


def test_other_errors_are_not_retried() -> None:
    retry = Retry(NoBackoff(), 5, (TransientError,), sleep=FakeTime().sleep)
    fn, calls = flaky([ConfigError("bad")])
    with pytest.raises(ConfigError):
        retry.call(fn)
    assert len(calls) == 1


def test_zero_retries_means_one_attempt() -> None:
    retry = Retry(NoBackoff(), 0, (TransientError,))
    fn, calls = flaky([TransientError("x")])
    with pytest.raises(TransientError):
        retry.call(fn)
    assert len(calls) == 1


def test_on_retry_sees_each_failure() -> None:
    seen: list[tuple[str, int]] = []
    retry = Retry(NoBackoff(), 3, (TransientError,), sleep=FakeTime().sleep)
    fn, _ = flaky([TransientError("a"), TransientError("b")])
    retry.call(fn, on_retry=lambda e, n: seen.append((str(e), n)))
    assert seen == [("a", 1), ("b", 2)]


def test_backoff_grows_exponentially_and_is_capped() -> None:
    b = ExponentialBackoff(base=0.01, cap=0.05, factor=2, jitter=0)
    assert [b.compute(n) for n in range(1, 6)] == pytest.approx([0.01, 0.02, 0.04, 0.05, 0.05])
    assert b.compute(10_000) == 0.05  # no overflow for absurd counts


def test_jitter_stays_within_its_band() -> None:
    values = iter([0.0, 0.999, 0.5])
    b = ExponentialBackoff(base=0.1, cap=1, jitter=0.5, rand=lambda: next(values))
    assert b.compute(1) == pytest.approx(0.1)
    assert 0.05 <= b.compute(1) <= 0.1
    assert b.compute(1) == pytest.approx(0.075)


def test_deadline_shortens_and_stops_retries() -> None:
    t = FakeTime()
    retry = Retry(
        ExponentialBackoff(base=0.4, cap=10, jitter=0),
        10,
        (TransientError,),
        deadline=1.0,
        sleep=t.sleep,
        clock=t.clock,
    )
    fn, calls = flaky([TransientError(str(i)) for i in range(10)])
    with pytest.raises(TransientError):
        retry.call(fn)
    assert sum(t.sleeps) <= 1.0 + 1e-9
    assert t.sleeps == pytest.approx([0.4, 0.6])  # the second wait is cut to the deadline
    assert len(calls) == 3


class SlowAttempts(FakeTime):
    """Each attempt takes ``attempt_s`` of fake time and fails."""

    def __init__(self, attempt_s: float) -> None:
        super().__init__()
        self.attempt_s = attempt_s
        self.starts: list[float] = []

    def fn(self) -> str:
        self.starts.append(self.now)
        self.now += self.attempt_s
        raise TransientError(f"attempt {len(self.starts)}")


def test_call_deadline_bounds_attempts_and_backoff() -> None:
    t = SlowAttempts(attempt_s=0.2)
    retry = Retry(
        ExponentialBackoff(base=0.05, cap=1, jitter=0),
        10,
        (TransientError,),
        min_attempt=0.01,
        sleep=t.sleep,
        clock=t.clock,
    )
    with pytest.raises(TransientError, match="attempt 2"):
        retry.call(t.fn, deadline=0.5)
    # attempts at 0 and 0.25; a third would start at 0.55 (after a 0.1 s backoff): not started,
    # and its backoff is not slept either
    assert t.starts == pytest.approx([0.0, 0.25])
    assert t.sleeps == pytest.approx([0.05])
    assert t.now <= 0.5


def test_call_deadline_needs_room_for_an_attempt() -> None:
    t = SlowAttempts(attempt_s=0.1)
    retry = Retry(NoBackoff(), 10, (TransientError,), min_attempt=0.05, clock=t.clock)
    with pytest.raises(TransientError, match="attempt 2"):
        retry.call(t.fn, deadline=0.24)
    assert t.starts == pytest.approx([0.0, 0.1])  # at 0.2 only 0.04 was left
    t.now = 1.0
    with pytest.raises(DeadlineExceededError):
        retry.call(t.fn, deadline=1.04)  # not even a first attempt
    assert len(t.starts) == 2


def test_past_deadline_raises_without_an_attempt() -> None:
    t = SlowAttempts(attempt_s=0.1)
    t.now = 5.0
    retry = Retry(NoBackoff(), 3, (TransientError,), clock=t.clock)
    with pytest.raises(DeadlineExceededError):
        retry.call(t.fn, deadline=5.0)
    assert t.starts == []
    assert issubclass(DeadlineExceededError, TransientError)


def test_no_deadline_keeps_every_retry() -> None:
    t = SlowAttempts(attempt_s=10.0)
    retry = Retry(NoBackoff(), 4, (TransientError,), sleep=t.sleep, clock=t.clock)
    with pytest.raises(TransientError, match="attempt 5"):
        retry.call(t.fn)
    assert len(t.starts) == 5


@pytest.mark.parametrize(
    "kwargs",
    [{"base": -1}, {"cap": -1}, {"factor": 0.5}, {"jitter": 1.5}],
)
def test_bad_backoff_is_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ExponentialBackoff(**kwargs)


def test_bad_retry_arguments_are_rejected() -> None:
    with pytest.raises(ValueError):
        Retry(NoBackoff(), -1, (TransientError,))
    with pytest.raises(ValueError):
        Retry(NoBackoff(), 1, (TransientError,), deadline=0)
    with pytest.raises(ValueError):
        Retry(NoBackoff(), 1, (TransientError,), min_attempt=-0.1)
