"""kvtier inside vLLM: a ``KVConnectorBase_V1`` connector (vLLM 0.32).

Run vLLM with::

    --kv-transfer-config '{"kv_connector": "KvtierConnectorV1",
        "kv_connector_module_path": "kvtier.connectors.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config": "kvtier.yaml"}}'

vLLM builds one instance per process: the **scheduler** side in its engine
core and the **worker** side next to the model. Both are the connector core
that the bundled engine runs too (``scheduler_side.py``: lookups, load
offers, the save plan; ``worker_side.py``: places loads into and gathers
saves out of vLLM's cache, through ``layouts.py``). Each
opens its own ``TieredStore`` from the kvtier configuration, so the tiers
that matter are the ones both processes see: a disk directory, a ``kvtier
serve`` cache server, Aerospike. A ``cpu`` tier is per process: in the
worker it keeps what it saved and loaded close, the scheduler's lookups do
not see it. This class only routes vLLM's calls to the side of its role,
reads vLLM's scheduler output (``vllm_steps.py``) and wraps what passes
between the sides (``plan.py``) in vLLM's types.

Configuration (``vllm_config.py``; docs/vllm.md): vLLM's version and
``kv_load_failure_policy`` are checked at construction; the namespace comes
from the weights' fingerprint and the KV geometry. Metrics:
``vllm:kvtier_*`` on vLLM's ``/metrics`` (``vllm_metrics.py``), and kvtier's
registry on ``metrics.port`` from the worker.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import vllm
from prometheus_client import CollectorRegistry
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.model_executor.models.utils import extract_layer_index

from kvtier.config import load_config
from kvtier.connectors.layouts import CPU_BACKEND, layout_for
from kvtier.connectors.plan import Counters, StepPlan, WorkerReport
from kvtier.connectors.scheduler_side import ConnectorScheduler
from kvtier.connectors.vllm_config import (
    VllmSettings,
    check_failure_policy,
    check_vllm_version,
    model_from_vllm,
    namespace_for,
    weights_fingerprint,
)
from kvtier.connectors.vllm_metrics import KvtierPromMetrics, KvtierStats
from kvtier.connectors.vllm_steps import build_step_plan
from kvtier.connectors.worker_side import ConnectorWorker
from kvtier.errors import ConfigError
from kvtier.factory import build_store
from kvtier.metrics import StoreMetrics
from kvtier.metrics_http import MetricsEndpoint, serve_metrics

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    """One step's plan, scheduler -> worker."""

    plan: StepPlan


@dataclass
class KvtierWorkerMetadata(KVConnectorWorkerMetadata):
    """One step's report, worker -> scheduler."""

    report: WorkerReport

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvtierWorkerMetadata)
        return KvtierWorkerMetadata(self.report.merge(other.report))


def _log_through_vllm() -> None:
    """kvtier's log records go where vLLM's go, in its format (vLLM configures only ``vllm``)."""
    ours, theirs = logging.getLogger("kvtier"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


class KvtierConnectorV1(KVConnectorBase_V1):
    """kvtier as vLLM's KV connector (see the module docstring).

    Raises:
        ConfigError: at construction, for an untested vLLM version, a
            ``kv_load_failure_policy`` other than ``recompute``, a bad
            ``kv_connector_extra_config`` or kvtier configuration, or a
            model or parallel setup the connector does not support.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_through_vllm()
        ktc = self._kv_transfer_config
        settings = VllmSettings.parse(ktc.kv_connector_extra_config)
        check_vllm_version(vllm.__version__, allow_untested=settings.allow_untested_vllm)
        check_failure_policy(ktc.kv_load_failure_policy)
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if groups is not None and len(groups) != 1:
            raise ConfigError(
                f"kvtier's vLLM connector supports models with one KV cache group (full "
                f"attention in every layer); this one has {len(groups)}"
            )
        self._config = load_config(settings.config)
        self._model = model_from_vllm(vllm_config)
        self._namespace = namespace_for(
            self._model, self._config, weights_fingerprint(self._model.model_dir)
        )
        self._metrics = StoreMetrics(CollectorRegistry())
        self._store = build_store(self._config, self._metrics)
        self._counters = Counters()
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        self._endpoint: MetricsEndpoint | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ConnectorScheduler(
                config=self._config,
                namespace=self._namespace,
                store=self._store,
                load_async=settings.loads_async(self._config),
                counters=self._counters,
                metrics=self._metrics,
            )
        else:
            self._worker = ConnectorWorker(
                config=self._config,
                store=self._store,
                counters=self._counters,
                metrics=self._metrics,
            )
            self._endpoint = serve_metrics(self._config.metrics, self._metrics.registry)
        log.info(
            "kvtier %s side: model %s (fingerprint %s), %d layers x %d KV heads x %d, %s, "
            "block size %d, tiers %s",
            role.name.lower(),
            self._model.model_id,
            self._namespace.weights_fingerprint,
            self._model.num_layers,
            self._model.num_kv_heads,
            self._model.head_dim,
            self._model.kv_dtype,
            self._model.block_size,
            [t.name for t in self._store.tiers],
        )
        if role == KVConnectorRole.SCHEDULER:
            # what `kvtier router --vllm-kv-events URL=...,namespace=FILE` reads from FILE, so
            # the router names this engine's blocks with the keys of its tier objects
            log.info("kvtier namespace: %s", json.dumps(self._namespace.to_json()))

    # ---- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        names = sorted(kv_caches, key=extract_layer_index)
        layers = [kv_caches[n] for n in names]
        m = self._model
        context = self._vllm_config.compilation_config.static_forward_context
        attn = context.get(names[0]) if names else None
        backend = attn.attn_backend.get_name() if attn is not None else CPU_BACKEND
        isa = getattr(attn, "isa", None)
        layout = layout_for(backend, layers, m.head_dim, isa)
        g = layout.geometry
        got = (g.num_layers, g.num_kv_heads, g.block_size, str(g.dtype).removeprefix("torch."))
        want = (m.num_layers, m.num_kv_heads, m.block_size, m.kv_dtype)
        if got != want:
            raise ConfigError(
                f"vLLM's KV cache (layers, KV heads, block size, dtype) {got} differs from its "
                f"configuration {want}; kvtier cannot address it"
            )
        self._worker.register(layout)
        log.info(
            "kvtier: %s KV cache, %d layers of %s (%s%s), moved in %d view(s)",
            backend,
            g.num_layers,
            tuple(layers[0].shape),
            g.dtype,
            f", ISA {isa}" if isa else "",
            layout.num_views if hasattr(layout, "num_views") else 1,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None and self.has_connector_metadata():
            self._worker.start_loads(self._plan().loads)
            self._worker.take_results()  # vLLM learns of failures through failed blocks

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads hold all layers: placed whole in start_load_kv (worker_side.py)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # saves hold all layers: gathered once the step's forward is over (wait_for_save)

    def wait_for_save(self) -> None:
        if self._worker is not None and self.has_connector_metadata():
            self._worker.save(self._plan().saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        sent, recvd = self._worker.finished(finished_req_ids)
        self._worker.take_results()  # vLLM learns of failures through failed blocks
        return sent or None, recvd or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report = self._worker.report() if self._worker is not None else None
        return KvtierWorkerMetadata(report) if report is not None else None

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        return meta.plan

    # ---- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        (block_ids,) = blocks.get_block_ids()
        self._scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return KvtierConnectorMetadata(build_step_plan(self._scheduler, scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        meta = connector_output.kv_connector_worker_meta
        report = meta.report if isinstance(meta, KvtierWorkerMetadata) else None
        self._scheduler.update(connector_output.finished_recving or (), report)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids), None

    # ---- both -------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data = self._counters.take()
        return KvtierStats(data=data) if data is not None else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KvtierStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save lost to preemption is a later miss

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.close()
        if self._endpoint is not None:
            self._endpoint.close()
        self._store.close()
