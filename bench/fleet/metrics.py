"""Figures of one simulated run: hit rates, latency percentiles, tier bandwidth, utilisation.

Definitions (docs/fleet.md):

* hit rates are over prompt tokens at the engine that computes the prompt:
  ``g1`` found in its own KV memory, ``tier`` loaded from the shared tier,
  ``total`` their sum; a P/D handoff is not a hit (it is counted as tier or
  peer traffic);
* TTFT: arrival at the router to the first token; ITL: every gap between
  two consecutive tokens of a request (a P/D handoff gap included; ``handoff``
  reports those gaps alone);
* tier GB/s: bytes read / written per window of ``window_s``, each transfer's
  bytes spread evenly over its duration, from the first arrival to the end;
* utilisation: busy seconds of an engine's step loop over the run's span.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvtier.bench.fleet.model import SimResult
from kvtier.bench.fleet.request import SimRequest


def weighted_percentile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The smallest value whose cumulative weight reaches ``q`` percent (NaN if empty)."""
    if len(values) == 0:
        return math.nan
    order = np.argsort(values, kind="stable")
    cw = np.cumsum(weights[order])
    i = int(np.searchsorted(cw, q / 100.0 * cw[-1], side="left"))
    return float(values[order][min(i, len(values) - 1)])


def percentile(values: list[float] | np.ndarray, q: float) -> float:
    """Unweighted :func:`weighted_percentile`."""
    a = np.asarray(values, dtype=float)
    return weighted_percentile(a, np.ones(len(a)), q)


def windowed_gbps(
    transfers: list[tuple[float, float, int]], start: float, end: float, window_s: float
) -> np.ndarray:
    """GB/s in each window of ``[start, end)``, each transfer spread over its duration."""
    n = max(1, math.ceil((end - start) / window_s))
    out = np.zeros(n)
    for t0, t1, nbytes in transfers:
        a, b = (t0 - start) / window_s, (t1 - start) / window_s
        if b - a < 1e-12:
            out[min(n - 1, max(0, int(a)))] += nbytes
            continue
        rate = nbytes / (b - a)
        for w in range(max(0, int(a)), min(n, math.ceil(b))):
            out[w] += rate * (min(b, w + 1) - max(a, w))
    return out / window_s / 1e9


def _latency(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": percentile(values, 50) * 1e3,
        "p99_ms": percentile(values, 99) * 1e3,
        "mean_ms": float(np.mean(values)) * 1e3 if values else math.nan,
    }


def _hits(reqs: list[SimRequest]) -> dict[str, float]:
    prompt = sum(r.prompt_tokens for r in reqs)
    g1 = sum(r.g1_tokens for r in reqs)
    tier = sum(r.tier_tokens for r in reqs)
    return {"g1": g1 / prompt, "tier": tier / prompt, "total": (g1 + tier) / prompt}


def summarize(result: SimResult, window_s: float = 1.0) -> dict[str, Any]:
    """The figures of a run, as one JSON-ready dict."""
    reqs = result.requests
    start = min(r.arrival_s for r in reqs)
    end = max(r.finish_s for r in reqs)
    span = end - start
    itl_v, itl_w = [], []
    for e in result.engines:
        v, w = e.itl_samples()
        itl_v.append(v)
        itl_w.append(w)
    iv, iw = np.concatenate(itl_v), np.concatenate(itl_w)
    by_kind: dict[str, list[tuple[float, float, int]]] = {"read": [], "write": [], "peer": []}
    for t in result.transfers:
        by_kind[t.kind].append((t.start_s, t.end_s, t.nbytes))
    traffic: dict[str, dict[str, float]] = {}
    for kind, items in by_kind.items():
        g = windowed_gbps(items, start, end, window_s)
        traffic[kind] = {
            "gb": sum(n for _, _, n in items) / 1e9,
            "mean_gbps": float(g.mean()),
            "p99_gbps": float(np.percentile(g, 99)),
            "peak_gbps": float(g.max()),
        }
    n_prefill = result.fleet.prefill_engines
    util = [e.busy_s / span for e in result.engines]
    counts = [e.requests for e in result.engines[:n_prefill]]
    handoff = [r.handoff_gap_s for r in reqs if r.handoff_gap_s >= 0]
    out: dict[str, Any] = {
        "requests": len(reqs),
        "span_s": span,
        "requests_per_s": len(reqs) / span,
        "hit_rate": _hits(reqs),
        "ttft": _latency([r.first_token_s - r.arrival_s for r in reqs]),
        "itl": {
            "p50_ms": weighted_percentile(iv, iw, 50) * 1e3,
            "p99_ms": weighted_percentile(iv, iw, 99) * 1e3,
            "samples": int(iw.sum()),
        },
        "queue_ms_mean": float(np.mean([r.admitted_s - r.arrival_s for r in reqs])) * 1e3,
        "tier": traffic,
        "utilisation": {
            "mean": float(np.mean(util)),
            "max": float(np.max(util)),
            "prefill_pool": float(np.mean(util[:n_prefill])),
            "decode_pool": float(np.mean(util[n_prefill:])) if n_prefill < len(util) else None,
        },
        "max_engine_share": max(counts) / sum(counts),
        "g1_evictions": sum(e.g1.evictions for e in result.engines),
        "tier_evictions": result.tier_evictions,
        "events": result.events,
    }
    if handoff:
        out["handoff"] = _latency(handoff)
    return out
