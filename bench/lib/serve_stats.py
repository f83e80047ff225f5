"""Percentiles and the per-run summary of ``bench/serve.py``.

Percentiles interpolate linearly between order statistics, as numpy's
default (``method="linear"``): for sorted values ``x[0..n-1]`` the q-th
percentile sits at rank ``(n - 1) * q / 100``; between two ranks the value
is interpolated. An empty sample has no percentile (``None``, JSON ``null``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvtier.bench.lib.serve_client import RunResult

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) of ``values`` by linear interpolation; None when empty.

    Raises:
        ValueError: if ``q`` is outside [0, 100].
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return None
    xs = sorted(values)
    rank = (len(xs) - 1) * q / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def summarize(result: RunResult) -> dict[str, Any]:
    """The figures of one run (the keys of one ``systems`` entry of the JSON line).

    Latencies count only requests that completed; ``requests_per_s`` and the
    token rates divide by the run's duration (start to last completion).
    """
    ok = result.ok
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [gap for r in ok for gap in r.itl_s]
    e2e = [r.e2e_s for r in ok]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    delay = [r.send_delay_s for r in result.records]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    output = sum(r.completion_tokens or 0 for r in ok)
    with_cached = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    cached = sum(r.cached_tokens or 0 for r in with_cached)
    prompt_with_cached = sum(r.prompt_tokens or 0 for r in with_cached)
    duration = result.duration_s
    out: dict[str, Any] = {
        "requests": len(ok),
        "errors": len(result.records) - len(ok),
        "error_kinds": dict(Counter(r.error_kind() for r in result.records if r.error)),
        "not_sent": result.not_sent,
        "duration_s": duration,
        "requests_per_s": _ratio(len(ok), duration),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "cached_tokens_usage": cached if with_cached else None,
        "prompt_tokens_per_s": _ratio(prompt, duration),
        "output_tokens_per_s": _ratio(output, duration),
        "hit_rate_usage": _ratio(cached, prompt_with_cached) if with_cached else None,
        "usage_missing": sum(1 for r in ok if r.completion_tokens is None),
        "itl_samples": len(itl),
        "pending_at_end": result.pending_at_end,
        "busy_fraction": result.busy_fraction(),
    }
    for q in PERCENTILES:
        out[f"ttft_p{q}_s"] = percentile(ttft, q)
        out[f"itl_p{q}_s"] = percentile(itl, q)
        out[f"e2e_p{q}_s"] = percentile(e2e, q)
    out["tpot_p50_s"] = percentile(tpot, 50)
    out["send_delay_p50_s"] = percentile(delay, 50)
    out["send_delay_max_s"] = max(delay) if delay else None
    return out
