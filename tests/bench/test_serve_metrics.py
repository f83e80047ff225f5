"""Parsing servers' /metrics and the hit rate of bench/serve.py (kvtier's and vLLM's names)."""

from __future__ import annotations

import pytest

from kvtier.bench.lib.serve_metrics import cache_counters, delta, parse_metrics, run_metrics, total

VLLM_BEFORE = """\
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="smollm2"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="smollm2"} 1.7e+09
# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="smollm2"} 100.0
# HELP vllm:num_preemptions Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="smollm2"} 0.0
"""
VLLM_AFTER = """\
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="smollm2"} 5000.0
vllm:prefix_cache_queries_total{engine="1",model_name="smollm2"} 1000.0
# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="smollm2"} 2100.0
vllm:prefix_cache_hits_total{engine="1",model_name="smollm2"} 500.0
# HELP vllm:external_prefix_cache_hits External prefix cache hits.
# TYPE vllm:external_prefix_cache_hits counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="smollm2"} 900.0
# HELP vllm:num_preemptions Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="smollm2"} 2.0
"""

KVTIER = """\
# TYPE kvtier_engine_time_to_first_token_seconds histogram
kvtier_engine_time_to_first_token_seconds_bucket{le="1.0"} 3.0
kvtier_engine_time_to_first_token_seconds_bucket{le="+Inf"} 4.0
kvtier_engine_time_to_first_token_seconds_count 4.0
kvtier_engine_time_to_first_token_seconds_sum 6.0
# TYPE kvtier_engine_prefix_cache_queries_tokens_total counter
kvtier_engine_prefix_cache_queries_tokens_total 4000.0
# TYPE kvtier_engine_prefix_cache_hit_tokens_total counter
kvtier_engine_prefix_cache_hit_tokens_total 1000.0
# TYPE kvtier_engine_external_loaded_tokens_total counter
kvtier_engine_external_loaded_tokens_total 2000.0
# TYPE kvtier_lookup_tokens_total counter
kvtier_lookup_tokens_total{kind="requested"} 3000.0
kvtier_lookup_tokens_total{kind="hit"} 2048.0
# TYPE kvtier_load_tokens_total counter
kvtier_load_tokens_total{outcome="loaded"} 2000.0
kvtier_load_tokens_total{outcome="failed"} 48.0
"""


def test_vllm_names_labels_summed_and_deltas() -> None:
    d = delta(parse_metrics(VLLM_BEFORE), parse_metrics(VLLM_AFTER))
    c = cache_counters(d)
    assert c is not None and c.source == "vllm"
    assert c.queried_tokens == 5000  # (5000 - 1000) + (1000 - 0), over both engines
    assert c.g1_hit_tokens == 2500
    assert c.external_hit_tokens == 900
    assert c.hit_rate == pytest.approx(3400 / 5000)
    assert run_metrics(d)["preemptions"] == 2


def test_kvtier_names_and_connector_view() -> None:
    m = run_metrics(parse_metrics(KVTIER))
    assert m["metrics_source"] == "kvtier"
    assert m["hit_rate"] == pytest.approx(3000 / 4000)
    assert m["g1_hit_rate"] == pytest.approx(0.25)
    assert m["external_hit_rate"] == pytest.approx(0.5)
    assert m["connector_lookup_hit_tokens"] == 2048
    assert m["connector_loaded_tokens"] == 2000
    assert m["server_ttft_mean_s"] == pytest.approx(1.5)
    assert "server_itl_mean_s" not in m  # no such histogram


def test_names_without_total_suffix() -> None:
    text = (
        "# TYPE vllm:prefix_cache_queries gauge\nvllm:prefix_cache_queries 10\n"
        "# TYPE vllm:prefix_cache_hits gauge\nvllm:prefix_cache_hits 4\n"
    )
    s = parse_metrics(text)
    assert total(s, "vllm:prefix_cache_queries_total") == 10
    c = cache_counters(s)
    assert c is not None and c.hit_rate == pytest.approx(0.4)


def test_no_counters_no_hit_rate() -> None:
    s = parse_metrics("# TYPE other_total counter\nother_total 3\n")
    assert cache_counters(s) is None
    assert run_metrics(s) == {"hit_rate": None}
    assert cache_counters(parse_metrics(KVTIER.replace("4000.0", "0.0"))).hit_rate is None  # type: ignore[union-attr]
