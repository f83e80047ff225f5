"""What one engine completes of the warm-start workload, and the arrival rate sized from it.

``bench/serve.py``'s sustained workload offers a calibrated share of what the
host computes (``serve_calibrate``: ``load / cost of a user``). The
warm-start phase (``router_warm.py``) does the same for its own requests,
measured on the engine under test (bundled or vLLM, whatever its dtype, block
size and attention over a 3,000-token context cost on this host), not
estimated from another engine's speeds::

    primed fleet engine (the hot documents in its G1)
        ◄── ``requests`` new questions on them, ``concurrency`` at a time, each
            sent when one before it completed (a closed loop: the engine is
            never idle, and batches what it can)
    capacity = completed requests / (last completion - first send)       requests/s
    rate     = load x capacity                                           both replicas

The questions go to the engine itself, not through the router, so they add
nothing to the router's hit statistics that warm-up reads.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

from kvtier.bench.lib.router_failover import Stream, stream_request
from kvtier.bench.lib.serve_stats import percentile


@dataclass(frozen=True)
class Capacity:
    """One closed-loop measurement: requests completed per second at ``concurrency`` in flight.

    Attributes:
        requests: Requests sent.
        concurrency: Requests in flight at once.
        elapsed_s: First send to last completion.
        e2e_s: Each completed request's send-to-last-byte time.
        ttft_s: Each completed request's time to its first token.
        errors: Requests that failed (not counted as completed).
        first_error: The first failed request's error, if any (for the message).
    """

    requests: int
    concurrency: int
    elapsed_s: float
    e2e_s: list[float]
    ttft_s: list[float]
    errors: int
    first_error: str | None = None

    @property
    def requests_per_s(self) -> float:
        """Completed requests per second (0.0 when none completed)."""
        return len(self.e2e_s) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @classmethod
    def of(cls, streams: list[Stream], elapsed_s: float, concurrency: int) -> Capacity:
        """The measurement of one closed loop (``send_closed_loop``'s streams and time)."""
        ok = [s for s in streams if s.error is None and s.ttft_s is not None]
        return cls(
            requests=len(streams),
            concurrency=concurrency,
            elapsed_s=elapsed_s,
            e2e_s=[s.e2e_s for s in ok],
            ttft_s=[s.ttft_s for s in ok if s.ttft_s is not None],
            errors=len(streams) - len(ok),
            first_error=next((s.error for s in streams if s.error is not None), None),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "requests_per_s": self.requests_per_s,
            "requests": self.requests,
            "completed": len(self.e2e_s),
            "errors": self.errors,
            "concurrency": self.concurrency,
            "elapsed_s": self.elapsed_s,
            "e2e_p50_s": percentile(self.e2e_s, 50),
            "ttft_p50_s": percentile(self.ttft_s, 50),
        }


def sized_rate(capacity: Capacity, load: float) -> float:
    """``load`` x the measured capacity: the arrivals both replicas get.

    Raises:
        ValueError: for a load outside (0, 1], or a measurement where nothing completed or
            a third of the requests failed (a rate from it would not be the engine's).
    """
    if not 0 < load <= 1:
        raise ValueError(f"load must be in (0, 1], got {load}")
    if not capacity.e2e_s or capacity.errors * 3 > capacity.requests:
        raise ValueError(
            f"the capacity measurement failed: {capacity.errors} of {capacity.requests} "
            f"requests failed (first: {capacity.first_error})"
        )
    return load * capacity.requests_per_s


async def send_closed_loop(
    url: str,
    messages: list[list[dict[str, str]]],
    *,
    concurrency: int,
    max_tokens: int,
    timeout_s: float,
    model: str = "smollm2",
) -> tuple[list[Stream], float]:
    """Sends every one of ``messages`` to ``url`` in order, ``concurrency`` at a time, each
    when one before it completed; returns the streams and first send to last completion.

    Raises:
        ValueError: for no messages or a concurrency below 1.
    """
    if not messages or concurrency < 1:
        raise ValueError("need at least one request and a concurrency of at least 1")
    streams = [Stream(i, m) for i, m in enumerate(messages)]
    queue: asyncio.Queue[Stream] = asyncio.Queue()
    for s in streams:
        queue.put_nowait(s)
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    t0 = time.perf_counter()
    last = t0
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:

        async def worker() -> None:
            nonlocal last
            while not queue.empty():
                s = queue.get_nowait()
                await stream_request(client, url, s, model, max_tokens)
                last = max(last, time.perf_counter())

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(streams)))))
    return streams, last - t0
