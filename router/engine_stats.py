"""What an engine's own ``/metrics`` says of its queue, KV memory and prefix cache.

The router's health checks scrape ``/metrics`` (``router/engines.py``); this
module reads the figures the scaling signals need, from the bundled engine
or from vLLM:

=================  ==========================================  =======================================
figure             kvtier engine                               vLLM
=================  ==========================================  =======================================
waiting            ``kvtier_engine_requests_waiting``          ``vllm:num_requests_waiting``
running            ``kvtier_engine_requests_running``          ``vllm:num_requests_running``
KV usage (0-1)     ``kvtier_engine_kv_blocks_used / _total``   ``vllm:kv_cache_usage_perc`` (a
                                                               fraction despite its name)
G1 hit tokens      ``kvtier_engine_prefix_cache_hit_tokens``   ``vllm:prefix_cache_hits``
tokens queried     ``kvtier_engine_prefix_cache_queries_       ``vllm:prefix_cache_queries``
                   tokens``
shared-tier hits   ``kvtier_engine_external_loaded_tokens``    ``vllm:external_prefix_cache_hits``
shared queried     –                                           ``vllm:external_prefix_cache_queries``
=================  ==========================================  =======================================

The last four are counters: hit rates are their increase over a window
(:class:`CounterWindow`, :func:`hit_rates`), G1 = hits / queried and shared =
shared hits / queried — over the tokens queried externally when the G1
query count did not grow (vLLM with ``--no-enable-prefix-caching`` counts
no G1 queries). Samples of one name (vLLM labels them by model and engine)
are summed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# figure -> sample names that carry it (summed)
_SAMPLES = {
    "waiting": ("kvtier_engine_requests_waiting", "vllm:num_requests_waiting"),
    "running": ("kvtier_engine_requests_running", "vllm:num_requests_running"),
    "kv_usage": ("vllm:kv_cache_usage_perc",),
    "kv_blocks_used": ("kvtier_engine_kv_blocks_used",),
    "kv_blocks_total": ("kvtier_engine_kv_blocks_total",),
    "prefix_hits": ("kvtier_engine_prefix_cache_hit_tokens_total", "vllm:prefix_cache_hits_total"),
    "prefix_queries": (
        "kvtier_engine_prefix_cache_queries_tokens_total",
        "vllm:prefix_cache_queries_total",
    ),
    "shared_hits": (
        "kvtier_engine_external_loaded_tokens_total",
        "vllm:external_prefix_cache_hits_total",
    ),
    "shared_queries": ("vllm:external_prefix_cache_queries_total",),
}
_BY_SAMPLE = {name: figure for figure, names in _SAMPLES.items() for name in names}
COUNTERS = ("prefix_hits", "prefix_queries", "shared_hits", "shared_queries")


@dataclass(frozen=True)
class EngineStats:
    """One scrape of an engine's ``/metrics`` (None: the engine does not export it).

    Attributes:
        waiting: Requests in its waiting queue.
        running: Requests in its running batch.
        kv_usage: Share of its KV memory (G1) in use, 0 to 1.
        counters: Cumulative ``prefix_hits``, ``prefix_queries``, ``shared_hits``,
            ``shared_queries`` (tokens; those the engine exports).
    """

    waiting: float | None
    running: float | None
    kv_usage: float | None
    counters: dict[str, float]


def parse_engine_stats(text: str) -> EngineStats | None:
    """The figures of an engine's Prometheus text (None when it is not Prometheus text)."""
    seen: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                figure = _BY_SAMPLE.get(s.name)
                if figure is not None:
                    seen[figure] = seen.get(figure, 0.0) + s.value
    except ValueError:
        return None
    usage = seen.get("kv_usage")
    total = seen.get("kv_blocks_total")
    if usage is None and total and "kv_blocks_used" in seen:
        usage = seen["kv_blocks_used"] / total
    return EngineStats(
        waiting=seen.get("waiting"),
        running=seen.get("running"),
        kv_usage=usage,
        counters={k: seen[k] for k in COUNTERS if k in seen},
    )


class CounterWindow:
    """Samples of cumulative counters; their increase over the last ``window_s`` seconds.

    Args:
        window_s: How far back the increase is measured.
        max_samples: Most samples kept (the oldest go first).

    Raises:
        ValueError: for a non-positive window or sample count.
    """

    def __init__(self, window_s: float, max_samples: int = 1024) -> None:
        if window_s <= 0 or max_samples < 2:
            raise ValueError("window_s must be positive and max_samples at least 2")
        self.window_s = window_s
        self._samples: deque[tuple[float, dict[str, float]]] = deque(maxlen=max_samples)

    def add(self, now: float, counters: dict[str, float]) -> None:
        """One sample of the counters at ``now``."""
        self._samples.append((now, dict(counters)))

    def increase(self, now: float, name: str) -> float | None:
        """How much ``name`` grew within the window (None: fewer than two samples, or a reset)."""
        cutoff = now - self.window_s
        while len(self._samples) > 2 and self._samples[1][0] <= cutoff:
            self._samples.popleft()  # NOTE: the last sample before the window is its base
        if len(self._samples) < 2:
            return None
        first, last = self._samples[0][1].get(name), self._samples[-1][1].get(name)
        if first is None or last is None or last < first:
            return None
        return last - first

    def ratio(self, now: float, num: str, den: str) -> float | None:
        """``increase(num) / increase(den)`` (None when the denominator did not grow)."""
        n, d = self.increase(now, num), self.increase(now, den)
        if n is None or d is None or d <= 0:
            return None
        return n / d


def hit_rates(window: CounterWindow, now: float) -> dict[str, float | None]:
    """``{"g1": ..., "shared": ...}`` over the window (None: nothing queried in it)."""
    shared = window.ratio(now, "shared_hits", "prefix_queries")
    if shared is None:
        shared = window.ratio(now, "shared_hits", "shared_queries")
    return {"g1": window.ratio(now, "prefix_hits", "prefix_queries"), "shared": shared}
