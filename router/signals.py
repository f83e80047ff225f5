"""Scaling signals: what the router measures of each engine's prefill work, over a sliding window.

Everything here takes the time as an argument (``now``, seconds on any
monotonic clock), so the router (``time.monotonic()``) and the fleet
simulation (simulated seconds, ``bench/fleet/scaling.py``) feed the very same
code. Memory is bounded: windows keep one bucket per ``bucket_s`` and at most
``max_samples`` latency samples.

One request's *attempt* at an engine::

    begin(engine, prefill_tokens)        routed there; prefill_tokens = prompt - hit (the
       │                                 router's estimate of what it must compute)
       ├─ queue_depth += 1, prefill_tokens_in_flight += prefill_tokens
       ▼
    prefill_done(attempt)                its first byte came back (or it failed): the engine
       │                                 no longer prefills it; idempotent
       ▼
    answered(attempt, ttft_s)            the client got a successful first byte: a TTFT
                                         sample, and its prefill tokens count as work done

Measured per engine, over the last ``window_s`` seconds:

* **busy seconds**: time with at least one attempt awaiting its first byte;
* **prefill capacity** (tokens/s) = uncached prompt tokens answered / busy
  seconds: the engine's effective prefill throughput under the real mix
  (queueing does not lower it, since waiting requests overlap in busy time;
  decode work sharing the steps does, as it should). Kept from the last
  window with at least ``min_busy_s`` busy seconds when the engine is quiet;
* **demand** (tokens/s): uncached prompt tokens routed there per second;
* **TTFT p50 / p99**: of answered requests.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile ``q`` (0-100] of ``values`` (None when empty).

    Raises:
        ValueError: if ``q`` is outside (0, 100].
    """
    if not 0 < q <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {q}")
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class SampleWindow:
    """Samples of the last ``window_s`` seconds (at most ``max_samples``: the oldest go first).

    Args:
        window_s: How far back samples count.
        max_samples: Most samples kept.

    Raises:
        ValueError: for a non-positive window or sample count.
    """

    def __init__(self, window_s: float, max_samples: int = 4096) -> None:
        if window_s <= 0 or max_samples < 1:
            raise ValueError("window_s and max_samples must be positive")
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, now: float, value: float) -> None:
        """One sample at ``now``."""
        self._samples.append((now, value))

    def values(self, now: float) -> list[float]:
        """The samples still in the window at ``now`` (older ones are dropped)."""
        cutoff = now - self.window_s
        while self._samples and self._samples[0][0] <= cutoff:
            self._samples.popleft()
        return [v for _, v in self._samples]

    def percentile(self, now: float, q: float) -> float | None:
        """Percentile ``q`` of the window (None when it is empty)."""
        return percentile(self.values(now), q)


class SumWindow:
    """A running sum over the last ``window_s`` seconds, in buckets of ``bucket_s``.

    Args:
        window_s: How far back amounts count.
        bucket_s: Resolution (an amount leaves the window with its bucket).

    Raises:
        ValueError: unless ``0 < bucket_s <= window_s``.
    """

    def __init__(self, window_s: float, bucket_s: float = 1.0) -> None:
        if not 0 < bucket_s <= window_s:
            raise ValueError("need 0 < bucket_s <= window_s")
        self.window_s = window_s
        self.bucket_s = bucket_s
        self._buckets: deque[list[float]] = deque()  # [bucket index, amount]

    def add(self, now: float, amount: float) -> None:
        """Adds ``amount`` at ``now``."""
        b = math.floor(now / self.bucket_s)
        if self._buckets and self._buckets[-1][0] == b:
            self._buckets[-1][1] += amount
        else:
            self._buckets.append([b, amount])
            self._drop(now)

    def total(self, now: float) -> float:
        """The sum of the amounts added in the window ending at ``now``."""
        self._drop(now)
        return sum(a for _, a in self._buckets)

    def _drop(self, now: float) -> None:
        first = math.floor(now / self.bucket_s) - math.ceil(self.window_s / self.bucket_s) + 1
        while self._buckets and self._buckets[0][0] < first:
            self._buckets.popleft()


@dataclass(eq=False)
class Attempt:
    """One request's try at one engine (``SignalTracker.begin`` makes it)."""

    engine: Hashable
    prefill_tokens: int
    started: float
    seq: int
    prefill_done_at: float | None = None
    answered: bool = False


@dataclass(frozen=True)
class EngineSignals:
    """One engine's signals at one moment (rates over the window).

    Attributes:
        queue_depth: Attempts routed there that await their first byte.
        prefill_tokens_in_flight: Their uncached prompt tokens.
        ttft_p50_s: TTFT median of answered requests (None: none in the window).
        ttft_p99_s: TTFT p99.
        ttft_samples: Answered requests in the window.
        demand_tokens_per_s: Uncached prompt tokens routed there per second.
        capacity_tokens_per_s: Measured prefill throughput (None: not measured yet).
        busy_fraction: Share of the window with a prefill awaiting its first byte.
    """

    queue_depth: int
    prefill_tokens_in_flight: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    ttft_samples: int
    demand_tokens_per_s: float
    capacity_tokens_per_s: float | None
    busy_fraction: float


@dataclass(frozen=True)
class FleetSignals:
    """The fleet's signals at one moment: every engine's, and their aggregate.

    Attributes:
        engines: Per engine (those the tracker has seen or was told of).
        queue_depth: Sum over engines.
        prefill_tokens_in_flight: Sum over engines.
        ttft_p50_s: Over every answered request in the window (not a mean of engines').
        ttft_p99_s: Likewise.
        ttft_samples: Answered requests in the window.
        demand_tokens_per_s: Uncached prompt tokens routed per second, all engines (those
            that left the fleet within the window included).
        capacity_tokens_per_s: Mean measured prefill capacity of one engine (None: none).
        window_s: The window the rates and percentiles are over.
    """

    engines: dict[Hashable, EngineSignals]
    queue_depth: int
    prefill_tokens_in_flight: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    ttft_samples: int
    demand_tokens_per_s: float
    capacity_tokens_per_s: float | None
    window_s: float


@dataclass
class _EngineState:
    ttft: SampleWindow
    demand: SumWindow
    done_tokens: SumWindow
    busy: SumWindow
    open: int = 0
    open_tokens: int = 0
    busy_mark: float = 0.0  # busy time before this is already in ``busy``
    capacity: float | None = None
    attempts: set[int] = field(default_factory=set)


class SignalTracker:
    """Per-engine prefill signals over a sliding window (one event loop; not thread-safe).

    Args:
        window_s: Window of the rates and percentiles.
        bucket_s: Resolution of the rate windows.
        max_samples: Most TTFT samples kept per engine and for the fleet.
        min_busy_s: Busy seconds a window needs before it measures capacity.
        start: The time the tracker starts at (rates are over
            ``min(window_s, now - start)`` until a whole window has passed).

    Raises:
        ValueError: for a non-positive window, bucket or sample count.
    """

    def __init__(
        self,
        window_s: float = 30.0,
        bucket_s: float = 1.0,
        max_samples: int = 4096,
        min_busy_s: float = 1.0,
        start: float = 0.0,
    ) -> None:
        if min_busy_s < 0:
            raise ValueError("min_busy_s must be >= 0")
        self.window_s = window_s
        self.bucket_s = bucket_s
        self.max_samples = max_samples
        self.min_busy_s = min_busy_s
        self.start = start
        self._fleet_ttft = SampleWindow(window_s, max_samples)
        self._fleet_demand = SumWindow(window_s, bucket_s)  # outlives engines that leave
        self._engines: dict[Hashable, _EngineState] = {}
        self._seq = 0

    def _state(self, engine: Hashable) -> _EngineState:
        s = self._engines.get(engine)
        if s is None:
            w, b = self.window_s, self.bucket_s
            s = _EngineState(SampleWindow(w, self.max_samples), SumWindow(w, b),
                             SumWindow(w, b), SumWindow(w, b))  # fmt: skip
            self._engines[engine] = s
        return s

    def add_engine(self, engine: Hashable) -> None:
        """Reports ``engine`` (with zeros) before any request reaches it."""
        self._state(engine)

    def remove_engine(self, engine: Hashable) -> None:
        """Forgets ``engine`` (it left the fleet); its open attempts count no more."""
        self._engines.pop(engine, None)

    @property
    def engines(self) -> list[Hashable]:
        """The engines tracked, in the order they were first seen."""
        return list(self._engines)

    # ---- events ----------------------------------------------------------------------------

    def _flush_busy(self, s: _EngineState, now: float) -> None:
        if s.open > 0 and now > s.busy_mark:
            s.busy.add(now, now - s.busy_mark)
        s.busy_mark = now

    def begin(self, engine: Hashable, prefill_tokens: int, now: float) -> Attempt:
        """A request was routed to ``engine`` with ``prefill_tokens`` to compute there."""
        s = self._state(engine)
        self._flush_busy(s, now)
        tokens = max(0, prefill_tokens)
        self._seq += 1
        a = Attempt(engine, tokens, now, self._seq)
        s.open += 1
        s.open_tokens += tokens
        s.attempts.add(a.seq)
        s.demand.add(now, tokens)
        self._fleet_demand.add(now, tokens)
        return a

    def prefill_done(self, attempt: Attempt, now: float) -> None:
        """``attempt``'s engine no longer prefills it (first byte, or failure). Idempotent."""
        if attempt.prefill_done_at is not None:
            return
        attempt.prefill_done_at = now
        s = self._engines.get(attempt.engine)
        if s is None or attempt.seq not in s.attempts:
            return
        self._flush_busy(s, now)
        s.attempts.discard(attempt.seq)
        s.open -= 1
        s.open_tokens -= attempt.prefill_tokens

    def answered(self, attempt: Attempt, ttft_s: float, now: float) -> None:
        """The client got ``attempt``'s first byte, ``ttft_s`` after it asked. Once per attempt."""
        self.prefill_done(attempt, now)
        if attempt.answered:
            return
        attempt.answered = True
        s = self._engines.get(attempt.engine)
        if s is None:
            return
        s.ttft.add(now, ttft_s)
        self._fleet_ttft.add(now, ttft_s)
        s.done_tokens.add(now, attempt.prefill_tokens)

    # ---- reading ---------------------------------------------------------------------------

    def _span(self, now: float) -> float:
        return max(self.bucket_s, min(self.window_s, now - self.start))

    def _engine(self, s: _EngineState, now: float) -> EngineSignals:
        self._flush_busy(s, now)
        span = self._span(now)
        busy = min(s.busy.total(now), span)
        done = s.done_tokens.total(now)
        if busy >= max(self.min_busy_s, 1e-9) and done > 0:
            s.capacity = done / busy
        ttft = s.ttft.values(now)
        return EngineSignals(
            queue_depth=s.open,
            prefill_tokens_in_flight=s.open_tokens,
            ttft_p50_s=percentile(ttft, 50),
            ttft_p99_s=percentile(ttft, 99),
            ttft_samples=len(ttft),
            demand_tokens_per_s=s.demand.total(now) / span,
            capacity_tokens_per_s=s.capacity,
            busy_fraction=busy / span,
        )

    def snapshot(self, now: float) -> FleetSignals:
        """Every engine's signals and the fleet's, at ``now``."""
        engines = {k: self._engine(s, now) for k, s in self._engines.items()}
        caps = [e.capacity_tokens_per_s for e in engines.values()]
        known = [c for c in caps if c is not None]
        ttft = self._fleet_ttft.values(now)
        return FleetSignals(
            engines=engines,
            queue_depth=sum(e.queue_depth for e in engines.values()),
            prefill_tokens_in_flight=sum(e.prefill_tokens_in_flight for e in engines.values()),
            ttft_p50_s=percentile(ttft, 50),
            ttft_p99_s=percentile(ttft, 99),
            ttft_samples=len(ttft),
            demand_tokens_per_s=self._fleet_demand.total(now) / self._span(now),
            capacity_tokens_per_s=sum(known) / len(known) if known else None,
            window_s=self.window_s,
        )
