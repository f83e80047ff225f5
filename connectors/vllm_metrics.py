"""kvtier's counters on vLLM's own ``/metrics``, through vLLM's connector-stats API.

Both connector sides count (``plan.Counters``): the scheduler side its
lookups and offers, the worker side its loads and saves. Each step vLLM asks
both for ``get_kv_connector_stats``, merges what they return and carries it
to the API server process, where ``KvtierPromMetrics.observe`` adds it to
these metrics of vLLM's registry (so they carry vLLM's ``model_name`` and
``engine`` labels)::

    vllm:kvtier_<counter>_total   for every name in plan.COUNTERS
    vllm:kvtier_load_seconds      histogram: one load, start to last token placed

kvtier's own registry (tier operations, latencies, corrupt blocks, the
store's fill) is served by the worker process on ``metrics.port`` when set
(``kvtier/metrics_http.py``); docs/metrics.md lists both.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvtier.connectors.plan import COUNTERS

LOAD_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class KvtierStats(KVConnectorStats):
    """``data``: ``{"counters": {name: n}, "load_seconds": [s, ...]}`` since the last report."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        counters: dict[str, float] = dict(self.data.get("counters", {}))
        for name, n in other.data.get("counters", {}).items():
            counters[name] = counters.get(name, 0.0) + n
        seconds = [*self.data.get("load_seconds", []), *other.data.get("load_seconds", [])]
        self.data = {"counters": counters, "load_seconds": seconds}
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data.get("counters", {}))
        seconds = self.data.get("load_seconds", [])
        if seconds:
            out["load_avg_s"] = round(sum(seconds) / len(seconds), 4)
        return out

    def is_empty(self) -> bool:
        return not self.data.get("counters") and not self.data.get("load_seconds")


class KvtierPromMetrics(KVConnectorPromMetrics):
    """The ``vllm:kvtier_*`` metrics (see the module docstring)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: create_metric_per_engine(
                self._counter_cls(
                    name=f"vllm:kvtier_{name}",
                    documentation=f"kvtier connector: {name.replace('_', ' ')}",
                    labelnames=labelnames,
                ),
                per_engine_labelvalues,
            )
            for name in COUNTERS
        }
        self._load_seconds = create_metric_per_engine(
            self._histogram_cls(
                name="vllm:kvtier_load_seconds",
                documentation="kvtier connector: one load, from its start to its last token placed",
                buckets=list(LOAD_SECONDS_BUCKETS),
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, n in transfer_stats_data.get("counters", {}).items():
            metric = self._counters.get(name)
            if metric is not None and n:
                metric[engine_idx].inc(n)
        for seconds in transfer_stats_data.get("load_seconds", []):
            self._load_seconds[engine_idx].observe(seconds)
