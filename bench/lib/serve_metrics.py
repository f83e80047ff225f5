"""A server's ``/metrics`` before and after a run, and the cache hit rate they give.

**Hit rate** (per system) = prompt tokens served from any cache / prompt
tokens looked up, both counted by the server over the run (deltas of its
counters):

* kvtier's engine: (``kvtier_engine_prefix_cache_hit_tokens_total`` (G1) +
  ``kvtier_engine_external_loaded_tokens_total`` (loaded by the KV
  connector)) / ``kvtier_engine_prefix_cache_queries_tokens_total``;
* vLLM: (``vllm:prefix_cache_hits_total`` + ``vllm:external_prefix_cache_hits_total``)
  / ``vllm:prefix_cache_queries_total``.

Both engines count a lookup when a request is admitted, so a preempted
request that is admitted again counts twice. Names are accepted with or
without the ``_total`` suffix; label sets (vLLM's ``engine``,
``model_name``) are summed. A server without these counters has no metric
hit rate (None); ``bench/serve.py`` then falls back to the usage-based rate,
``usage.prompt_tokens_details.cached_tokens`` / ``usage.prompt_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

# (sample name, sorted label pairs) -> value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> Samples:
    """Every sample of a Prometheus text exposition.

    Raises:
        ValueError: if the text is not valid exposition format.
    """
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def total(samples: Samples, name: str, **labels: str) -> float | None:
    """Sum of ``name`` (or ``name`` without ``_total``) over label sets that match ``labels``."""
    names = {name, name.removesuffix("_total")}
    values = [
        v
        for (n, lbl), v in samples.items()
        if n in names and all(dict(lbl).get(k) == want for k, want in labels.items())
    ]
    return sum(values) if values else None


def delta(before: Samples, after: Samples) -> Samples:
    """``after - before`` per sample (a sample new in ``after`` counts from 0)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


@dataclass(frozen=True)
class CacheCounters:
    """Prompt-token cache counters of one server over one run."""

    source: str
    queried_tokens: float
    g1_hit_tokens: float
    external_hit_tokens: float

    @property
    def hit_rate(self) -> float | None:
        if self.queried_tokens <= 0:
            return None
        return (self.g1_hit_tokens + self.external_hit_tokens) / self.queried_tokens

    def to_dict(self) -> dict[str, Any]:
        q = self.queried_tokens
        return {
            "metrics_source": self.source,
            "queried_tokens": q,
            "g1_hit_tokens": self.g1_hit_tokens,
            "external_hit_tokens": self.external_hit_tokens,
            "hit_rate": self.hit_rate,
            "g1_hit_rate": self.g1_hit_tokens / q if q > 0 else None,
            "external_hit_rate": self.external_hit_tokens / q if q > 0 else None,
        }


# source -> (queries, G1 hits, external hits)
_NAMES = {
    "kvtier": (
        "kvtier_engine_prefix_cache_queries_tokens_total",
        "kvtier_engine_prefix_cache_hit_tokens_total",
        "kvtier_engine_external_loaded_tokens_total",
    ),
    "vllm": (
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:external_prefix_cache_hits_total",
    ),
}
_PREEMPTIONS = ("kvtier_engine_preemptions_total", "vllm:num_preemptions_total")
# The server's own latency histograms: their means over the run check the client's figures.
_HISTOGRAMS = {
    "server_ttft_mean_s": (
        "kvtier_engine_time_to_first_token_seconds",
        "vllm:time_to_first_token_seconds",
    ),
    "server_itl_mean_s": (
        "kvtier_engine_inter_token_latency_seconds",
        "vllm:inter_token_latency_seconds",
    ),
}


def histogram_mean(d: Samples, name: str) -> float | None:
    """Mean of a histogram over a delta (``_sum`` / ``_count``); None without observations."""
    count = total(d, name + "_count")
    if not count:
        return None
    return (total(d, name + "_sum") or 0.0) / count


def cache_counters(d: Samples) -> CacheCounters | None:
    """The hit counters found in a metrics delta; None when the server has neither naming."""
    for source, (queries, hits, external) in _NAMES.items():
        q = total(d, queries)
        if q is None:
            continue
        return CacheCounters(source, q, total(d, hits) or 0.0, total(d, external) or 0.0)
    return None


def run_metrics(d: Samples) -> dict[str, Any]:
    """What a metrics delta says about one run (cache counters, preemptions, connector)."""
    counters = cache_counters(d)
    out: dict[str, Any] = counters.to_dict() if counters else {"hit_rate": None}
    for name in _PREEMPTIONS:
        n = total(d, name)
        if n is not None:
            out["preemptions"] = n
    for key, names in _HISTOGRAMS.items():
        for name in names:
            mean = histogram_mean(d, name)
            if mean is not None:
                out[key] = mean
    computed = total(d, "kvtier_engine_prompt_tokens_total")
    if computed is not None:  # prompt tokens the model computed (a recompute counts again)
        out["computed_prompt_tokens"] = computed
    hit = total(d, "kvtier_lookup_tokens_total", kind="hit")
    if hit is not None:  # the kvtier connector's own view (docs/metrics.md)
        requested = total(d, "kvtier_lookup_tokens_total", kind="requested") or 0.0
        out["connector_lookup_hit_tokens"] = hit
        out["connector_lookup_requested_tokens"] = requested
        out["connector_loaded_tokens"] = (
            total(d, "kvtier_load_tokens_total", outcome="loaded") or 0.0
        )
    return out


def scrape(base_url: str, *, timeout_s: float = 30.0) -> Samples | None:
    """The server's ``/metrics``, or None when it has none (404) or cannot be parsed."""
    try:
        resp = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout_s, trust_env=False)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        return parse_metrics(resp.text)
    except ValueError:
        return None
