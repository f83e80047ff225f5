"""kvtier behind the bundled engine's connector interface.

Scheduler side: the request's prompt is cut into chunk keys (namespace from
the model fingerprint and KV layout), the store is asked for the longest
present prefix, and the engine is told how many tokens it can load —
chunk-aligned, except that when the whole prompt is cached all but its last
token are loaded (the last chunk is scattered partially), and never less
than ``connector.min_load_tokens``.

Worker side: ``start_load_kv`` starts fetching on an I/O thread;
``wait_for_load`` waits up to ``connector.load_timeout_s``, then decodes,
dequantizes and scatters on the engine's thread and reports, per request, how
many tokens are valid — the engine recomputes the rest. ``save_kv`` gathers
newly completed chunks out of the paged cache (a copy) and queues them for a
background thread that encodes and stores them.

Every failure — a missing or corrupt block, a dead tier, a slow fetch — is a
recompute, counted in the store's metrics (``kvtier_load_tokens_total``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field

import torch

from kvtier.block import BlockSpec, Compression, Encoding
from kvtier.config import KvtierConfig, load_config
from kvtier.connectors.loader import place_chunks
from kvtier.connectors.saver import ChunkSaver, SaveStats
from kvtier.engine.connector import (
    ConnectorRequest,
    KVConnector,
    LoadMetadata,
    LoadOutcome,
    LoadSpec,
    RequestLoadResult,
    SaveMetadata,
    SaveSpec,
)
from kvtier.engine.kv_cache import KVCacheLayout
from kvtier.errors import ConfigError, KvtierError
from kvtier.factory import build_store
from kvtier.kernels import gather_kv, gather_kv_quantized, slots_for_tokens
from kvtier.keys import CacheNamespace, ChunkKey, chunk_keys
from kvtier.metrics import StoreMetrics
from kvtier.store import TieredStore

log = logging.getLogger(__name__)


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
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    last_errors: list[str] = field(default_factory=list)


@dataclass
class _RequestState:
    keys: list[ChunkKey]  # full chunks of the prompt (extended over decode tokens when saved)
    partial_key: ChunkKey | None  # the prompt's trailing partial chunk (save_partial_chunks)
    prompt_chunks: int  # full chunks in the prompt
    stored_chunks: int = 0  # leading full chunks known to be in the store (hits or saved)
    partial_saved: bool = False

    def lookup_keys(self) -> list[ChunkKey]:
        """The prompt's keys, chunk ``i`` at index ``i`` (the partial chunk last)."""
        keys = self.keys[: self.prompt_chunks]
        return keys if self.partial_key is None else [*keys, self.partial_key]


@dataclass
class _PendingLoad:
    spec: LoadSpec
    groups: list[tuple[int, concurrent.futures.Future[list[bytes | None]]]]  # (first chunk, fetch)


def fetch_groups(first: int, last: int) -> list[tuple[int, int]]:
    """Chunks ``first..last`` as ``(start, stop)`` groups of 1, 1, 2, 4, ... chunks.

    Small groups first let the scatter start while later chunks are still
    being read; doubling keeps the number of tier calls (round trips, for a
    network tier) logarithmic in the prefix length.
    """
    groups = []
    size = 1
    start = first
    while start <= last:
        stop = min(last + 1, start + size)
        groups.append((start, stop))
        if len(groups) > 1:
            size *= 2
        start = stop
    return groups


class KvtierConnector(KVConnector):
    """The kvtier connector.

    Args:
        config_path: kvtier YAML configuration (``None``: ``$KVTIER_CONFIG`` or defaults).
        config: A configuration object instead of a file.
        store: Use this store instead of building one from the configuration
            (the caller keeps ownership: ``shutdown`` does not close it).
        metrics: Where to count (the store's metrics by default).
    """

    def __init__(
        self,
        config_path: str | None = None,
        *,
        config: KvtierConfig | None = None,
        store: TieredStore | None = None,
        metrics: StoreMetrics | None = None,
    ) -> None:
        self.config = config if config is not None else load_config(config_path)
        if store is None:
            self.store = build_store(self.config, metrics)
            self._owns_store = True
        else:
            self.store = store
            self._owns_store = False
        self.metrics = self.store.metrics
        self.stats = ConnectorStats()
        cc = self.config.connector
        self._chunk = self.config.chunk_size
        self._encoding = Encoding.parse(self.config.block.encoding)
        self._partial = self.config.save_partial_chunks
        self._saver = ChunkSaver(
            self.store,
            encoding=self._encoding,
            compression=Compression.parse(self.config.block.compression),
            max_queue=cc.save_queue,
            metrics=self.metrics,
        )
        self._io = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvtier-load"
        )
        self._requests: dict[str, _RequestState] = {}
        self._pending: list[_PendingLoad] = []
        self._kv_cache: torch.Tensor | None = None
        self._layout: KVCacheLayout | None = None
        self._ns: CacheNamespace | None = None
        self._spec: BlockSpec | None = None

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
        )
        self._spec = BlockSpec(
            layout.num_layers, layout.num_kv_heads, layout.head_dim, kv_cache.dtype
        )

    @property
    def namespace(self) -> CacheNamespace | None:
        """The namespace of this engine's KV (after ``register_kv_caches``)."""
        return self._ns

    # ---- scheduler side ----------------------------------------------------

    def _state(self, request: ConnectorRequest) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            assert self._ns is not None
            prompt = request.prompt_token_ids
            keys = chunk_keys(prompt, self._ns, include_partial=self._partial)
            partial = keys.pop() if self._partial and len(prompt) % self._chunk else None
            state = _RequestState(keys=keys, partial_key=partial, prompt_chunks=len(keys))
            self._requests[request.request_id] = state
        return state

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> int:
        if self._ns is None:
            return 0
        first_time = request.request_id not in self._requests
        state = self._state(request)
        prompt_len = len(request.prompt_token_ids)
        with self.metrics.time_stage("lookup"):
            hit_chunks = self.store.lookup(state.lookup_keys())
        state.stored_chunks = max(state.stored_chunks, min(hit_chunks, prompt_len // self._chunk))
        hit_tokens = min(hit_chunks * self._chunk, prompt_len)
        if first_time:
            self.stats.lookups += 1
            self.stats.lookup_tokens += prompt_len
            self.stats.hit_tokens += hit_tokens
            self.metrics.lookup_tokens.labels("requested").inc(prompt_len)
            self.metrics.lookup_tokens.labels("hit").inc(hit_tokens)
        end = min(hit_tokens, prompt_len - 1)  # at least one token is computed
        n = end - num_computed_tokens
        return n if n >= self.config.connector.min_load_tokens else 0

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> None:
        self._requests.pop(request.request_id, None)

    # ---- worker side: load ---------------------------------------------

    def start_load_kv(self, metadata: LoadMetadata) -> None:
        for spec in metadata.requests:
            state = self._requests.get(spec.request_id)
            if state is None or spec.num_tokens <= 0:
                continue
            first = spec.start // self._chunk
            last = (spec.start + spec.num_tokens - 1) // self._chunk
            keys = state.lookup_keys()
            groups = [
                (start, self._io.submit(self.store.get, keys[start:stop]))
                for start, stop in fetch_groups(first, last)
            ]
            self._pending.append(_PendingLoad(spec, groups))

    def wait_for_load(self) -> LoadOutcome:
        pending, self._pending = self._pending, []
        results: dict[str, RequestLoadResult] = {}
        deadline = time.monotonic() + self.config.connector.load_timeout_s
        for p in pending:
            spec = p.spec
            t0 = time.perf_counter()
            with self.metrics.time_stage("load"):
                loaded, nbytes, error = self._finish_load(p, deadline)
            self.stats.load_seconds += time.perf_counter() - t0
            self.stats.load_requests += 1
            failed = loaded < spec.num_tokens
            results[spec.request_id] = RequestLoadResult(loaded_tokens=loaded, failed=failed)
            self.stats.loaded_tokens += loaded
            self.stats.bytes_loaded += nbytes
            self.metrics.load_tokens.labels("loaded").inc(loaded)
            if failed:
                state = self._requests.get(spec.request_id)
                if state is not None:
                    # What was not loaded is recomputed: let save_kv store it again.
                    state.stored_chunks = min(
                        state.stored_chunks, (spec.start + loaded) // self._chunk
                    )
                self.stats.load_failures += 1
                self.stats.failed_tokens += spec.num_tokens - loaded
                self.metrics.load_tokens.labels("failed").inc(spec.num_tokens - loaded)
                self.stats.last_errors = [
                    *self.stats.last_errors[-9:],
                    f"{spec.request_id}: {error}",
                ]
                log.info(
                    "kvtier load for %s: %d of %d tokens (%s); recomputing the rest",
                    spec.request_id,
                    loaded,
                    spec.num_tokens,
                    error,
                )
        return LoadOutcome(results)

    def _finish_load(self, p: _PendingLoad, deadline: float) -> tuple[int, int, str | None]:
        """Place each group as its fetch completes; stop at the first gap, failure or timeout."""
        spec = p.spec
        end = spec.start + spec.num_tokens
        assert self._kv_cache is not None and self._layout is not None and self._spec is not None
        loaded = nbytes = 0
        for i, (first_chunk, future) in enumerate(p.groups):
            try:
                blocks = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                error = f"fetch timed out after {self.config.connector.load_timeout_s}s"
            except KvtierError as e:
                error = f"fetch failed: {e}"
            else:
                start = max(spec.start, first_chunk * self._chunk)
                placement = place_chunks(
                    blocks,
                    first_chunk=first_chunk,
                    chunk_size=self._chunk,
                    start=start,
                    end=min(end, (first_chunk + len(blocks)) * self._chunk),
                    block_ids=spec.block_ids,
                    block_size=self._layout.block_size,
                    kv_cache=self._kv_cache,
                    spec=self._spec,
                )
                loaded = start - spec.start + placement.loaded_tokens
                nbytes += placement.bytes_loaded
                error = placement.error
            if error is not None:
                for _, later in p.groups[i:]:
                    later.cancel()  # never written: the engine recomputes from here
                return loaded, nbytes, error
        return loaded, nbytes, None

    # ---- worker side: save ---------------------------------------------

    def save_kv(self, metadata: SaveMetadata) -> None:
        if self._kv_cache is None or self._ns is None:
            return
        for spec in metadata.requests:
            if spec.phase == "decode" and not self.config.connector.save_decode:
                continue
            self._save_request(spec)

    def _save_request(self, spec: SaveSpec) -> None:
        assert self._ns is not None and self._layout is not None
        state = self._requests.get(spec.request_id)
        if state is None:
            return
        limit = (
            spec.num_computed_prompt_tokens if spec.phase == "prefill" else spec.num_computed_tokens
        )
        n_full = limit // self._chunk
        if n_full > len(state.keys):
            # Decode went past the prompt: extend the keys over the generated tokens.
            state.keys = chunk_keys(spec.token_ids[: n_full * self._chunk], self._ns)
        for c in range(state.stored_chunks, n_full):
            self._save_chunk(state.keys[c], spec.block_ids, c * self._chunk, self._chunk)
        state.stored_chunks = max(state.stored_chunks, n_full)
        if state.partial_key is not None and spec.prefill_done and not state.partial_saved:
            start = (spec.num_prompt_tokens // self._chunk) * self._chunk
            self._save_chunk(
                state.partial_key, spec.block_ids, start, spec.num_prompt_tokens - start
            )
            state.partial_saved = True

    def _save_chunk(self, key: ChunkKey, block_ids: list[int], start: int, num_tokens: int) -> None:
        assert self._kv_cache is not None and self._layout is not None
        slots = slots_for_tokens(
            block_ids, self._layout.block_size, start, num_tokens, device=self._kv_cache.device
        )
        kv = self._kv_cache
        if kv.is_cuda and self._encoding != Encoding.RAW:
            # Fused gather + quantize on the device; the saver only encodes.
            q = gather_kv_quantized(kv, slots, self._encoding.label)
            # A blocking copy: the saver thread must not see a copy still in flight.
            self._saver.submit(key, type(q)(q.data.cpu(), q.scales.cpu()), kv.dtype)
        else:
            chunk = gather_kv(kv, slots)  # a copy: the slots may be reused once the request ends
            self._saver.submit(key, chunk.cpu() if chunk.is_cuda else chunk, kv.dtype)

    # ---- lifecycle -------------------------------------------------------

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued save has reached the store's tiers."""
        return self._saver.flush(timeout)

    @property
    def save_stats(self) -> SaveStats:
        """What the background saver did."""
        return self._saver.stats

    def shutdown(self) -> None:
        self._saver.close(timeout=30.0)
        self._io.shutdown(wait=False, cancel_futures=True)
        if self._owns_store:
            self.store.close()
