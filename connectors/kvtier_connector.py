"""kvtier behind the bundled engine's connector interface: the core's adapter for this engine.

The connector core is the same for every engine: the scheduler side
(``scheduler_side.py``) looks requests up, offers loads and plans saves; the
worker side (``worker_side.py``) moves bytes through a layout adapter
(``layouts.EngineKV`` here; vLLM's CPU and CUDA layouts in ``vllm.py``).
The bundled engine runs both sides in its one step thread, so this class
only translates the engine's calls (``engine/connector.py``) and passes the
plan and the worker's report between the sides at once::

    engine                               core
    ──────                               ────
    register_kv_caches(kv, layout)       namespace; worker.register(EngineKV(kv))
    get_num_new_matched_tokens(R, n)     scheduler: lookup, offer ─► (n, asynchronous) | None
    update_state_after_alloc(R, ids, n)  scheduler: the load is planned
    start_load_kv(meta)                  worker.start_loads(the planned loads)
    get_finished()                       worker.finished() ─► LoadOutcome; report ─► scheduler
    save_kv(meta)                        scheduler.plan_saves(R, computed) ─► worker.save
    request_finished(R, ids)             worker drops R's load; scheduler plans R's last
                                         saves ─► worker.save now (the blocks are freed next)

Loads are asynchronous (the request waits in LOADING, the others keep
stepping); verification, decode saves, tails, lookups off the step thread,
metrics and the failure rules are the core's, the same as under vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvtier.config import KvtierConfig, load_config
from kvtier.connectors.layouts import EngineKV
from kvtier.connectors.load_job import Fetcher
from kvtier.connectors.lookup import LookupStats
from kvtier.connectors.plan import Counters, LoadResult
from kvtier.connectors.saver import SaveStats
from kvtier.connectors.scheduler_side import ConnectorScheduler
from kvtier.connectors.verify import ChunkVerifier, Quarantine, Sampler, VerifyStats
from kvtier.connectors.worker_side import ConnectorWorker
from kvtier.engine.connector import (
    ConnectorRequest,
    KVConnector,
    LoadMetadata,
    LoadOutcome,
    RequestLoadResult,
    SaveMetadata,
)
from kvtier.engine.kv_cache import KVCacheLayout
from kvtier.errors import ConfigError
from kvtier.factory import build_store
from kvtier.keys import CacheNamespace, KeyHash
from kvtier.metrics import StoreMetrics
from kvtier.metrics_http import serve_metrics
from kvtier.store import TieredStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectorStats:
    """Totals since start, for the demo, benchmarks and tests (metrics carry the same)."""

    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    load_requests: int = 0
    loaded_tokens: int = 0
    failed_tokens: int = 0
    load_failures: int = 0
    loads_refused: int = 0  # lookups or offers refused, every I/O thread stuck: a miss
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    last_errors: list[str] = field(default_factory=list)


class KvtierConnector(KVConnector):
    """The kvtier connector of the bundled engine.

    Args:
        config_path: kvtier YAML configuration (``None``: ``$KVTIER_CONFIG`` or defaults).
        config: A configuration object instead of a file.
        store: Use this store instead of building one from the configuration
            (the caller keeps ownership: ``shutdown`` does not close it).
        metrics: Where to count (the store's metrics by default).
        verify_sampler: Decides which loadable objects are verified (by default
            each with probability ``connector.verify_fraction``).
    """

    def __init__(
        self,
        config_path: str | None = None,
        *,
        config: KvtierConfig | None = None,
        store: TieredStore | None = None,
        metrics: StoreMetrics | None = None,
        verify_sampler: Sampler | None = None,
    ) -> None:
        self.config = config if config is not None else load_config(config_path)
        self._owns_store = store is None
        self.store = store if store is not None else build_store(self.config, metrics)
        self.metrics = self.store.metrics
        try:  # metrics.port: this process's /metrics (kvtier/metrics_http.py)
            self.metrics_endpoint = serve_metrics(self.config.metrics, self.metrics.registry)
        except ConfigError:
            if self._owns_store:
                self.store.close()
            raise
        self.counters = Counters(keep_samples=False)
        # NOTE: one pool of I/O threads for lookups and loads: both sides are in this process
        self._fetcher = Fetcher(self.store, self.config.connector.load_workers)
        self.quarantine = Quarantine()
        self.worker = ConnectorWorker(
            config=self.config,
            store=self.store,
            counters=self.counters,
            metrics=self.metrics,
            fetcher=self._fetcher,
            quarantine=self.quarantine,
        )
        self._sampler = verify_sampler
        self.scheduler: ConnectorScheduler | None = None  # needs the namespace: register_kv_caches
        self._sync_results: list[LoadResult] = []
        self._on_evicted: Callable[[bytes], None] | None = None

    # ---- registration ----------------------------------------------------------------------

    def register_kv_caches(self, kv_cache: torch.Tensor, layout: KVCacheLayout) -> None:
        chunk = self.config.chunk_size
        if chunk % layout.block_size:
            raise ConfigError(
                f"chunk_size {chunk} must be a multiple of the engine block size {layout.block_size}"
            )
        namespace = CacheNamespace(
            model_id=layout.model_id,
            weights_fingerprint=layout.fingerprint,
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            kv_dtype=layout.dtype,
            chunk_size=chunk,
            key_hash=KeyHash.parse(self.config.keys.hash),
        )
        self.scheduler = ConnectorScheduler(
            config=self.config,
            namespace=namespace,
            store=self.store,
            load_async=True,
            counters=self.counters,
            metrics=self.metrics,
            verify_sampler=self._sampler,
            fetcher=self._fetcher,
            quarantine=self.quarantine,
            offer_once=False,  # a preempted request is offered its hit again
        )
        self.worker.register(EngineKV(kv_cache))

    @property
    def namespace(self) -> CacheNamespace | None:
        """The namespace of this engine's KV (after ``register_kv_caches``)."""
        return self.scheduler.namespace if self.scheduler is not None else None

    # ---- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> int | tuple[int, bool] | None:
        if self.scheduler is None:
            return 0
        n, load_async = self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        if n is None:
            return None  # still looking up: the engine asks again next step
        return n, load_async

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if self.scheduler is not None:
            self.scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> None:
        if self.scheduler is None:
            return
        # a load in flight is dropped: never placed into blocks that are about to be freed
        self.worker.abandon([request.request_id])
        if self.scheduler.request_finished(request, block_ids):
            # the request ends: store prompt + answer now, before its blocks are freed
            self.worker.save(self.scheduler.take_plan().saves)
        self._report()

    # ---- worker side -------------------------------------------------------------------------

    def start_load_kv(self, metadata: LoadMetadata) -> None:
        if self.scheduler is None:
            return
        plan = self.scheduler.take_plan()
        self.worker.start_loads(plan.loads)
        self.worker.save(plan.saves)
        self._sync_results = self.worker.take_results()

    def wait_for_load(self) -> LoadOutcome:
        """Synchronous loads (none: every offer is asynchronous) are placed in ``start_load_kv``."""
        results, self._sync_results = self._sync_results, []
        return self._outcome(results)

    def get_finished(self) -> LoadOutcome:
        if self.scheduler is None:
            return LoadOutcome()
        _, ended = self.worker.finished()
        outcome = self._outcome(self.worker.take_results())
        self.scheduler.update(ended, self.worker.report())
        return outcome

    def wait_for_async_loads(self, timeout_s: float) -> None:
        self._fetcher.wakeup.clear()
        if self.scheduler is not None and self.scheduler.any_lookup_answered():
            return  # a lookup answered: its request can be admitted
        if self.worker.loads_ready():
            return  # something to place already
        self._fetcher.wakeup.wait(timeout_s)

    def save_kv(self, metadata: SaveMetadata) -> None:
        if self.scheduler is None:
            return
        for spec in metadata.requests:
            decode = spec.phase == "decode"
            self.scheduler.plan_saves(
                spec.request_id,
                spec.num_computed_tokens if decode else spec.num_computed_prompt_tokens,
                decode=decode,
                token_ids=spec.token_ids,
                block_ids=spec.block_ids,
            )
        self.worker.save(self.scheduler.take_plan().saves)
        self._report()

    def _report(self) -> None:
        report = self.worker.report()
        if report is not None and self.scheduler is not None:
            self.scheduler.update((), report)

    @staticmethod
    def _outcome(results: list[LoadResult]) -> LoadOutcome:
        return LoadOutcome(
            {r.request_id: RequestLoadResult(r.placed, failed=r.failed) for r in results}
        )

    # ---- what it did ---------------------------------------------------------------------------

    @property
    def stats(self) -> ConnectorStats:
        """Totals since start (``counters`` has every one)."""
        t = self.counters.totals
        refused = t["refused_lookups"]
        if self.scheduler is not None:
            refused += self.scheduler.refused_offers
        return ConnectorStats(
            lookups=int(t["lookups"]),
            lookup_tokens=int(t["lookup_tokens"]),
            hit_tokens=int(t["hit_tokens"]),
            load_requests=int(t["loads"]),
            loaded_tokens=int(t["loaded_tokens"]),
            failed_tokens=int(t["failed_tokens"]),
            load_failures=int(t["load_failures"]),
            loads_refused=int(refused),
            bytes_loaded=int(t["loaded_bytes"]),
            load_seconds=self.counters.load_seconds_total,
            last_errors=list(self.worker.last_errors),
        )

    @property
    def lookup_stats(self) -> LookupStats:
        """Lookups deferred a step, timed out, or refused (``connectors/lookup.py``)."""
        return self.scheduler.lookup_stats if self.scheduler is not None else LookupStats()

    @property
    def save_stats(self) -> SaveStats:
        """What the background saver did."""
        return self.worker.save_stats

    @property
    def verify_stats(self) -> VerifyStats:
        """What sampled verification found (all zero when it is off)."""
        return self.worker.verify_stats

    @property
    def verifier(self) -> ChunkVerifier | None:
        """The verifier (once an object was handed to it)."""
        return self.worker.verifier

    @property
    def on_saved(self) -> Callable[[bytes], None] | None:
        """Told the key of every object queued for saving (the engine's KV events)."""
        return self.worker.on_saved

    @on_saved.setter
    def on_saved(self, callback: Callable[[bytes], None] | None) -> None:
        self.worker.on_saved = callback

    @property
    def on_evicted(self) -> Callable[[bytes], None] | None:
        """Told the key of every object the store's last tier evicts for capacity (the
        engine's KV events: ``unsaved``). Called on the evicting thread, under the tier's
        lock: it must be quick and must not call into the store."""
        return self._on_evicted

    @on_evicted.setter
    def on_evicted(self, callback: Callable[[bytes], None] | None) -> None:
        self._on_evicted = callback
        # NOTE: the last tier's listener is free: write-back installs listeners on the
        # tiers above it only. An upper tier's eviction leaves the object below it.
        self.store.tiers[-1].set_evicted_key_listener(callback)

    # ---- lifecycle ---------------------------------------------------------------------------

    def flush(self, timeout: float = 30.0) -> bool:
        """Waits until every queued save has reached the store's tiers and every queued check ran."""
        done = self.worker.flush(timeout)
        self._report()  # what the verifier found wrong is quarantined by the time this returns
        return done

    def shutdown(self) -> None:
        self.worker.close()
        if self.scheduler is not None:
            self.scheduler.close()
        self._fetcher.shutdown()
        if self._owns_store:
            self.store.close()
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.close()
