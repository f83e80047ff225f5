"""kvtier behind the bundled engine's connector interface.

Scheduler side: the request's prompt gets a key for every block boundary
(``kvtier.keys.PrefixKeys``; namespace from the model fingerprint and KV
layout); one batched ``contains`` finds the longest stored prefix — full
chunks, then the longest stored tail (``prefix.py``); the engine is told how
many tokens it can load, all but the prompt's last token at most, never fewer
than ``connector.min_load_tokens``, and that the load is **asynchronous**.

Worker side: ``start_load_kv`` starts a ``LoadJob`` per request — its objects
fetched on a bounded pool of I/O threads with one deadline for the whole
load (``connector.load_timeout_s``, retries included) — and returns at once.
``get_finished``, called by the engine at the start of each step, places
(decodes, dequantizes, scatters) whatever has arrived and reports each load
once it is over: all of it, or the tokens before a missing or corrupt
block, a failure or the deadline; the engine recomputes the rest. Other
requests keep stepping meanwhile. ``save_kv`` gathers newly completed chunks
(and, when a prompt's prefill ends, its block-aligned tail) out of the paged
cache — a copy — and queues them for a background thread that encodes and
stores them; with ``connector.save_decode`` chunks completed while decoding
and, when the request ends, the tail of prompt plus answer are saved too, so
the next round of a conversation loads what this one generated.

Every failure — a missing or corrupt block, a dead or stalled tier — is a
recompute, counted in the store's metrics (``kvtier_load_tokens_total``).

With ``connector.verify_fraction`` a load stops before a sampled object;
the engine computes it and what follows, and each of those objects is
compared with its stored block off the step thread (``verify.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.block import BlockSpec, Compression, Encoding
from kvtier.config import KvtierConfig, effective_verify_fraction, load_config
from kvtier.connectors.load_job import Fetcher, LoadJob, Placed
from kvtier.connectors.loader import place_chunks
from kvtier.connectors.lookup import AsyncLookups, LookupStats
from kvtier.connectors.prefix import ObjectRef
from kvtier.connectors.request_state import RequestState
from kvtier.connectors.saver import ChunkSaver, SaveStats
from kvtier.connectors.verify import (
    ChunkVerifier,
    Quarantine,
    Sampler,
    VerifyStats,
    random_sampler,
)
from kvtier.engine.connector import (
    ConnectorRequest,
    KVConnector,
    LoadMetadata,
    LoadOutcome,
    RequestLoadResult,
    SaveMetadata,
    SaveSpec,
)
from kvtier.engine.kv_cache import KVCacheLayout
from kvtier.errors import ConfigError
from kvtier.factory import build_store
from kvtier.kernels import gather_kv, gather_kv_quantized, slots_for_tokens
from kvtier.keys import CacheNamespace, KeyHash
from kvtier.metrics import StoreMetrics
from kvtier.metrics_http import serve_metrics
from kvtier.store import TieredStore

log = logging.getLogger(__name__)

# A request that waits for blocks is asked for its match every step; its
# lookup is reused for this long.
LOOKUP_REUSE_S = 1.0


@dataclass
class ConnectorStats:
    """Running totals, for the demo, benchmarks and tests (metrics carry the same)."""

    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    load_requests: int = 0
    loaded_tokens: int = 0
    failed_tokens: int = 0
    load_failures: int = 0
    loads_refused: int = 0  # every I/O thread busy (a stalled tier): served as a miss
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    last_errors: list[str] = field(default_factory=list)


@dataclass
class _Load:
    """A load in flight and what placing it needs."""

    job: LoadJob
    block_ids: list[int]
    started: float  # perf_counter


class KvtierConnector(KVConnector):
    """The kvtier connector.

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
        if store is None:
            self.store = build_store(self.config, metrics)
            self._owns_store = True
        else:
            self.store = store
            self._owns_store = False
        self.metrics = self.store.metrics
        try:  # metrics.port: this process's /metrics (kvtier/metrics_http.py)
            self.metrics_endpoint = serve_metrics(self.config.metrics, self.metrics.registry)
        except ConfigError:
            if self._owns_store:
                self.store.close()
            raise
        self.stats = ConnectorStats()
        cc = self.config.connector
        self._chunk = self.config.chunk_size
        self._block_tokens = self.config.block_tokens
        self._encoding = Encoding.parse(self.config.block.encoding)
        self._tails = self.config.save_partial_chunks
        self._saver = ChunkSaver(
            self.store,
            encoding=self._encoding,
            compression=Compression.parse(self.config.block.compression),
            max_queue=cc.save_queue,
            metrics=self.metrics,
        )
        self._fetcher = Fetcher(self.store, cc.load_workers)
        # sampled verification of hits (verify.py): the verifier starts with the KV layout
        self._sample = verify_sampler
        fraction = effective_verify_fraction(self.config)
        if self._sample is None and fraction > 0:
            self._sample = random_sampler(fraction)
            log.info("kvtier: sampled verification of %.3g of loaded chunks", fraction)
        self.quarantine = Quarantine()
        self._lookups = AsyncLookups(
            self._fetcher,
            timeout_s=cc.lookup_timeout_s,
            metrics=self.metrics,
            quarantine=self.quarantine,
            on_count=self._lookup_counted,
        )
        self._verifier: ChunkVerifier | None = None
        self._requests: dict[str, RequestState] = {}
        self._jobs: dict[str, _Load] = {}
        self._kv_cache: torch.Tensor | None = None
        self._layout: KVCacheLayout | None = None
        self._ns: CacheNamespace | None = None
        self._spec: BlockSpec | None = None
        # told the key of every object queued for saving (the engine's KV events)
        self.on_saved: Callable[[bytes], None] | None = None

    # ---- worker side: registration --------------------------------------

    def register_kv_caches(self, kv_cache: torch.Tensor, layout: KVCacheLayout) -> None:
        if self._chunk % layout.block_size:
            raise ConfigError(
                f"chunk_size {self._chunk} must be a multiple of the engine block size {layout.block_size}"
            )
        self._kv_cache = kv_cache
        self._layout = layout
        self._ns = CacheNamespace(
            model_id=layout.model_id,
            weights_fingerprint=layout.fingerprint,
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            kv_dtype=layout.dtype,
            chunk_size=self._chunk,
            key_hash=KeyHash.parse(self.config.keys.hash),
        )
        self._spec = BlockSpec(
            layout.num_layers,
            layout.num_kv_heads,
            layout.head_dim,
            kv_cache.dtype,
            max_tokens=self._chunk,
        )
        if self._sample is not None and self._verifier is None:
            self._verifier = ChunkVerifier(
                self.store,
                spec=self._spec,
                quarantine=self.quarantine,
                metrics=self.metrics,
                max_queue=self.config.connector.save_queue,
                fetch_timeout_s=self.config.connector.load_timeout_s,
            )

    @property
    def lookup_stats(self) -> LookupStats:
        """Lookups deferred a step, timed out, or refused (``connectors/lookup.py``)."""
        return self._lookups.stats

    def _lookup_counted(self, what: str) -> None:
        if what == "refused":  # every I/O thread stuck on a tier: the hit is not offered
            self.stats.loads_refused += 1

    @property
    def namespace(self) -> CacheNamespace | None:
        """The namespace of this engine's KV (after ``register_kv_caches``)."""
        return self._ns

    # ---- scheduler side ----------------------------------------------------

    def _state(self, request: ConnectorRequest) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            assert self._ns is not None
            state = RequestState.new(self._ns, self._block_tokens, request.prompt_token_ids)
            self._requests[request.request_id] = state
        return state

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> int | tuple[int, bool] | None:
        if self._ns is None:
            return 0
        state = self._state(request)
        first_time = state.prefix is None
        if not state.lookup_is_fresh(LOOKUP_REUSE_S):
            prefix = self._lookups.poll(request.request_id, state)
            if prefix is None:
                return None  # still looking up: the engine asks again next step
            state.remember_lookup(prefix)
        assert state.prefix is not None
        prompt_len = state.num_prompt_tokens
        hit_tokens = state.prefix.num_tokens
        if first_time:
            self.stats.lookups += 1
            self.stats.lookup_tokens += prompt_len
            self.stats.hit_tokens += hit_tokens
            self.metrics.lookup_tokens.labels("requested").inc(prompt_len)
            self.metrics.lookup_tokens.labels("hit").inc(hit_tokens)
        end = min(hit_tokens, prompt_len - 1)  # at least one token is computed
        if self._sample is not None:  # a sampled object is computed, then compared
            end = state.plan_verification(num_computed_tokens, end, self._sample)
        n = end - num_computed_tokens
        if n < self.config.connector.min_load_tokens:
            return 0
        if self._fetcher.saturated:  # every I/O thread is stuck on a tier: do not queue behind it
            self.stats.loads_refused += 1
            self.metrics.load_tokens.labels("refused").inc(n)
            return 0
        return n, True

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> None:
        state = self._requests.pop(request.request_id, None)
        self._lookups.cancel(request.request_id)
        load = self._jobs.pop(request.request_id, None)
        if load is not None:
            load.job.abandon()  # never placed into blocks that are about to be freed
        if state is None or self._kv_cache is None or not self.config.connector.save_decode:
            return
        # the request ends: store prompt + answer so the next round of a conversation loads it
        tokens = request.all_token_ids
        computed = request.num_computed_tokens
        for obj in state.chunks_to_save(tokens, computed):
            self._save_object(obj, block_ids)
        if self._tails:
            tail = state.tail_to_save(tokens, computed)
            if tail is not None:
                self._save_object(tail, block_ids)

    # ---- worker side: load ---------------------------------------------

    def start_load_kv(self, metadata: LoadMetadata) -> None:
        deadline = time.monotonic() + self.config.connector.load_timeout_s
        for spec in metadata.requests:
            state = self._requests.get(spec.request_id)
            if state is None or state.prefix is None or spec.num_tokens <= 0:
                continue
            job = LoadJob(
                request_id=spec.request_id,
                start=spec.start,
                end=spec.start + spec.num_tokens,
                objects=state.prefix.objects_from(spec.start),
                deadline=deadline,
            )
            job.begin(self._fetcher)
            self._jobs[spec.request_id] = _Load(job, spec.block_ids, time.perf_counter())

    def wait_for_load(self) -> LoadOutcome:
        """Synchronous loads are never requested: every match is asynchronous."""
        return LoadOutcome()

    def get_finished(self) -> LoadOutcome:
        results: dict[str, RequestLoadResult] = {}
        for rid, load in list(self._jobs.items()):
            ids = load.block_ids
            with self.metrics.time_stage("place"):
                done = load.job.advance(
                    lambda b, o, lo, hi, ids=ids: self._place(b, o, lo, hi, ids)
                )
            if done:
                del self._jobs[rid]
                results[rid] = self._finish(load)
        return LoadOutcome(results)

    def wait_for_async_loads(self, timeout_s: float) -> None:
        fetcher = self._fetcher
        fetcher.wakeup.clear()
        if self._lookups.any_answered():
            return  # a lookup answered: its request can be admitted
        for load in self._jobs.values():
            job = load.job
            if job.groups and (job.groups[0][1].done() or time.monotonic() >= job.deadline):
                return  # something to place already
        fetcher.wakeup.wait(timeout_s)

    def _place(
        self,
        blocks: Sequence[bytes | None],
        objects: Sequence[ObjectRef],
        lo: int,
        hi: int,
        block_ids: list[int],
    ) -> Placed:
        assert self._kv_cache is not None and self._layout is not None and self._spec is not None
        placement = place_chunks(
            list(blocks),
            keys=[o.key for o in objects],
            first_chunk=objects[0].start // self._chunk,
            chunk_size=self._chunk,
            start=lo,
            end=hi,
            block_ids=block_ids,
            block_size=self._layout.block_size,
            kv_cache=self._kv_cache,
            spec=self._spec,
        )
        if placement.corrupt is not None:
            # NOTE: the store already checked checksums and keys and deleted what
            # failed; what is left here is a header that lies about its size or
            # layout (an lz4 size beyond the chunk): counted, recomputed.
            self.metrics.count_corrupt("load", placement.corrupt)
        return Placed(placement.loaded_tokens, placement.bytes_loaded, placement.error)

    def _finish(self, load: _Load) -> RequestLoadResult:
        job = load.job
        wanted = job.end - job.start
        loaded = job.placed
        seconds = time.perf_counter() - load.started
        self.metrics.stage_latency.labels("load").observe(seconds)
        self.stats.load_seconds += seconds
        self.stats.load_requests += 1
        self.stats.loaded_tokens += loaded
        self.stats.bytes_loaded += job.nbytes
        self.metrics.load_tokens.labels("loaded").inc(loaded)
        failed = loaded < wanted
        if failed:
            state = self._requests.get(job.request_id)
            if state is not None:
                state.load_failed_at(job.start + loaded)  # recomputed, so saved again
            self.stats.load_failures += 1
            self.stats.failed_tokens += wanted - loaded
            self.metrics.load_tokens.labels("failed").inc(wanted - loaded)
            self.stats.last_errors = [
                *self.stats.last_errors[-9:],
                f"{job.request_id}: {job.error}",
            ]
            log.info(
                "kvtier load for %s: %d of %d tokens (%s); recomputing the rest",
                job.request_id,
                loaded,
                wanted,
                job.error,
            )
        return RequestLoadResult(loaded_tokens=loaded, failed=failed)

    # ---- worker side: save ---------------------------------------------

    def save_kv(self, metadata: SaveMetadata) -> None:
        if self._kv_cache is None or self._ns is None:
            return
        for spec in metadata.requests:
            if spec.phase == "decode" and not self.config.connector.save_decode:
                continue
            self._save_request(spec)

    def _save_request(self, spec: SaveSpec) -> None:
        state = self._requests.get(spec.request_id)
        if state is None:
            return
        decode = spec.phase == "decode"
        computed = spec.num_computed_tokens if decode else spec.num_computed_prompt_tokens
        for obj in state.chunks_to_save(spec.token_ids, computed):
            self._save_object(obj, spec.block_ids)
        if self._tails and spec.prefill_done and not decode:
            tail = state.tail_to_save(spec.token_ids, spec.num_prompt_tokens, exact=True)
            if tail is not None:
                self._save_object(tail, spec.block_ids)
        if self._verifier is not None:
            for obj in state.verifiable(computed):
                self._verify_object(obj, spec.block_ids)

    def _verify_object(self, obj: ObjectRef, block_ids: list[int]) -> None:
        assert self._kv_cache is not None and self._layout is not None
        assert self._verifier is not None
        slots = slots_for_tokens(
            block_ids,
            self._layout.block_size,
            obj.start,
            obj.num_tokens,
            device=self._kv_cache.device,
        )
        chunk = gather_kv(self._kv_cache, slots)  # a copy: compared later, on the verifier's thread
        self._verifier.submit(obj.key, chunk.cpu())

    def _save_object(self, obj: ObjectRef, block_ids: list[int]) -> None:
        assert self._kv_cache is not None and self._layout is not None
        if obj.key in self.quarantine:  # this process found it wrong: do not store it again
            return
        slots = slots_for_tokens(
            block_ids,
            self._layout.block_size,
            obj.start,
            obj.num_tokens,
            device=self._kv_cache.device,
        )
        kv = self._kv_cache
        if kv.is_cuda and self._encoding != Encoding.RAW:
            # Fused gather + quantize on the device; the saver only encodes.
            q = gather_kv_quantized(kv, slots, self._encoding.label)
            # A blocking copy: the saver thread must not see a copy still in flight.
            queued = self._saver.submit(obj.key, type(q)(q.data.cpu(), q.scales.cpu()), kv.dtype)
        else:
            chunk = gather_kv(kv, slots)  # a copy: the slots may be reused once the request ends
            queued = self._saver.submit(obj.key, chunk.cpu() if chunk.is_cuda else chunk, kv.dtype)
        if queued and self.on_saved is not None:
            self.on_saved(obj.key)

    # ---- lifecycle -------------------------------------------------------

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued save has reached the store's tiers and every queued check ran."""
        deadline = time.monotonic() + timeout
        saved = self._saver.flush(timeout)
        if self._verifier is None:
            return saved
        return self._verifier.flush(max(0.0, deadline - time.monotonic())) and saved

    @property
    def verify_stats(self) -> VerifyStats:
        """What sampled verification found (all zero when it is off)."""
        return self._verifier.stats if self._verifier is not None else VerifyStats()

    @property
    def verifier(self) -> ChunkVerifier | None:
        """The verifier (after ``register_kv_caches``, when verification is on)."""
        return self._verifier

    @property
    def save_stats(self) -> SaveStats:
        """What the background saver did."""
        return self._saver.stats

    def shutdown(self) -> None:
        for load in self._jobs.values():
            load.job.abandon()
        self._jobs.clear()
        self._saver.close(timeout=30.0)
        if self._verifier is not None:
            self._verifier.close(timeout=30.0)
        self._fetcher.shutdown()
        if self._owns_store:
            self.store.close()
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.close()
