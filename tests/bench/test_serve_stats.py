"""Percentiles and the per-run summary of bench/serve.py."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvtier.bench.lib.serve_client import RequestRecord, RunResult
from kvtier.bench.lib.serve_stats import percentile, summarize


def test_percentile_known_values() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 * (4 - 3)
    assert percentile([7.0], 99) == 7.0
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)


def test_percentile_matches_numpy_linear() -> None:
    rng = random.Random(3)
    for n in (1, 2, 5, 37, 1000):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 99.9, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)


def test_percentile_empty_and_out_of_range() -> None:
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    with pytest.raises(ValueError):
        percentile([1.0], -1)


def _rec(
    ttft: float, itl: list[float], *, error: str | None = None, cached: int | None = 50
) -> RequestRecord:
    return RequestRecord(
        lane="u",
        turn=0,
        scheduled_s=0.0,
        sent_s=1.0,
        e2e_s=ttft + sum(itl),
        ttft_s=ttft,
        itl_s=itl,
        content_chunks=len(itl) + 1,
        prompt_tokens=100,
        completion_tokens=len(itl) + 1,
        cached_tokens=cached,
        error=error,
    )


def test_summarize_counts_rates_and_excludes_errors() -> None:
    records = [
        _rec(0.1, [0.01, 0.02]),
        _rec(0.3, [0.03, 0.04]),
        _rec(9.0, [5.0], error="dropped: stream ended before [DONE]"),
    ]
    s = summarize(RunResult(records, duration_s=2.0, not_sent=4))
    assert s["requests"] == 2 and s["errors"] == 1 and s["not_sent"] == 4
    assert s["error_kinds"] == {"dropped": 1}
    assert s["ttft_p50_s"] == pytest.approx(0.2)  # the failed request's 9 s is not a sample
    assert s["itl_samples"] == 4
    assert s["itl_p50_s"] == pytest.approx(0.025)
    assert s["requests_per_s"] == pytest.approx(1.0)
    assert s["prompt_tokens"] == 200 and s["output_tokens"] == 6
    assert s["prompt_tokens_per_s"] == pytest.approx(100.0)
    assert s["output_tokens_per_s"] == pytest.approx(3.0)
    assert s["hit_rate_usage"] == pytest.approx(0.5)


def test_summarize_without_cached_tokens_or_requests() -> None:
    s = summarize(RunResult([_rec(0.1, [0.01], cached=None)], duration_s=1.0, not_sent=0))
    assert s["hit_rate_usage"] is None and s["cached_tokens_usage"] is None
    empty = summarize(RunResult([], duration_s=0.0, not_sent=3))
    assert empty["requests"] == 0 and empty["ttft_p99_s"] is None
    assert empty["requests_per_s"] is None


def _span(sent: float, e2e: float) -> RequestRecord:
    return RequestRecord(lane="u", turn=0, scheduled_s=sent, sent_s=sent, e2e_s=e2e, ttft_s=0.1)


def test_busy_fraction_and_pending_at_the_end_of_the_send_window() -> None:
    # in flight: [1, 3] and [2, 4] overlap -> [1, 4]; [6, 7]; [9, 12] crosses the window's end
    records = [_span(1.0, 2.0), _span(2.0, 2.0), _span(6.0, 1.0), _span(9.0, 3.0)]
    result = RunResult(records, duration_s=12.0, not_sent=0, send_window_s=10.0)
    # busy [1, 4] + [6, 7] + [9, 10] = 5 s of the 9 s from the first send to the window's end
    assert result.busy_fraction() == pytest.approx(5.0 / 9.0)
    assert result.pending_at_end == 1
    s = summarize(result)
    assert s["pending_at_end"] == 1 and s["busy_fraction"] == pytest.approx(5.0 / 9.0)
    assert RunResult([], duration_s=1.0, not_sent=0).busy_fraction() is None
