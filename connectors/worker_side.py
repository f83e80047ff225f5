"""The connector's worker side: places loads into an engine's cache, gathers saves out of it.

Runs on the thread that runs the engine's forward pass and does what the
scheduler side planned (``plan.py``), through the cache's layout adapter
(``layouts.py``: the bundled engine's, vLLM's CPU and CUDA ones)::

    start_loads     each PlannedLoad becomes a LoadJob (load_job.py): its objects fetched on a
                    bounded pool of I/O threads, one deadline (connector.load_timeout_s)
                    sync:  placed now, before the forward pass reads the blocks
                    async: placed by ``finished``, step after step, as groups arrive
    save            each PlannedSave: gather the objects out of the cache (a copy: the
                    blocks may be reused once the step ends) ─► ChunkSaver thread
                    (quantize, encode, store.put); its ``verify`` objects likewise
                    ─► ChunkVerifier thread (fetch the stored block, compare; a wrong
                    one is deleted from every tier and its key reported back)
    finished        asynchronous loads that ended (their LoadResults in ``take_results``);
                    finished requests whose last saves were gathered
    report          failed loads, stuck load threads, bad keys ─► the scheduler side

Placing decodes each fetched block for the key it was fetched under, checks
it holds exactly the object's tokens, and scatters the window of it the load
needs through the layout (dequantized on the way when it was stored
quantized; fused on the device where the layout can). The first missing,
corrupt or late object ends the load: what came before it stays, what
follows is recomputed by the engine — a failed block is never served.

**One load per request, all layers at once.** Objects hold every layer of
their tokens (the stored format), so a load cannot be pipelined layer by
layer against the forward pass. What a hit leaves to compute is at most a
chunk, so the forward pass after a load is short; the load itself is what
takes time, and it runs before (sync) or beside (async) the engine's steps.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvtier.block import BlockSpec, Compression, Encoding, decode_block
from kvtier.config import KvtierConfig
from kvtier.connectors.layouts import PagedKV
from kvtier.connectors.load_job import Fetcher, LoadJob, Placed, PlaceFn
from kvtier.connectors.plan import (
    Counters,
    LoadResult,
    PlannedLoad,
    PlannedSave,
    WorkerReport,
)
from kvtier.connectors.saver import ChunkSaver, SaveStats
from kvtier.connectors.verify import ChunkVerifier, Quarantine, VerifyStats
from kvtier.errors import CorruptBlockError
from kvtier.kernels import KernelInputError, dequantize_chunk
from kvtier.metrics import StoreMetrics
from kvtier.prefix import ObjectRef
from kvtier.store import TieredStore

log = logging.getLogger(__name__)

_SYNC_POLL_S = 0.05  # longest wait between checks of a synchronous load (the fetch wakes it)
_LAST_ERRORS = 10


@dataclass
class _Load:
    job: LoadJob
    spec: PlannedLoad
    started: float  # perf_counter


class ConnectorWorker:
    """The worker side (see the module docstring).

    Args:
        config: kvtier's configuration.
        store: Where loads come from and saves go.
        counters: Where to count.
        metrics: kvtier's metrics.
        fetcher: The I/O threads loads run on (default: its own pool).
        quarantine: Where the verifier puts keys it found wrong (default: its own;
            they reach the scheduler side through ``report`` either way).
    """

    def __init__(
        self,
        *,
        config: KvtierConfig,
        store: TieredStore,
        counters: Counters,
        metrics: StoreMetrics,
        fetcher: Fetcher | None = None,
        quarantine: Quarantine | None = None,
    ) -> None:
        self._config = config
        self._counters = counters
        self._metrics = metrics
        cc = config.connector
        self._encoding = Encoding.parse(config.block.encoding)
        self._owns_fetcher = fetcher is None
        self.fetcher = fetcher if fetcher is not None else Fetcher(store, cc.load_workers)
        self._saver = ChunkSaver(
            store,
            encoding=self._encoding,
            compression=Compression.parse(config.block.compression),
            max_queue=cc.save_queue,
            metrics=metrics,
        )
        self._store = store
        self._quarantine = quarantine
        self._verifier: ChunkVerifier | None = None  # started by the first object to verify
        self._bad_keys: list[bytes] = []  # found wrong, not yet reported (verifier's thread)
        self._bad_lock = threading.Lock()
        self._layout: PagedKV | None = None
        self.spec: BlockSpec | None = None
        """What a stored block of this cache must look like (after ``register``)."""
        self._jobs: dict[str, _Load] = {}  # asynchronous loads in flight
        self._results: list[LoadResult] = []  # ended, not yet taken
        self._errors: set[int] = set()  # failed blocks not yet reported
        self._failed: dict[str, int] = {}  # request -> first token its load did not place
        self._new_failures: dict[str, int] = {}  # not yet in a WorkerReport
        self._released: set[str] = set()  # finished requests whose last saves were gathered
        self._recent_finished: tuple[set[str], set[str]] = (set(), set())
        self._reported_stuck = False
        self.last_errors: list[str] = []
        """Why the last few loads ended early (newest last)."""
        self.on_saved: Callable[[bytes], None] | None = None
        """Told the key of every object queued for saving (the bundled engine's KV events)."""

    def register(self, layout: PagedKV) -> None:
        """The engine's caches, through their layout."""
        g = layout.geometry
        self._layout = layout
        self.spec = BlockSpec(
            g.num_layers, g.num_kv_heads, g.head_dim, g.dtype, max_tokens=self._config.chunk_size
        )

    # ---- loads ---------------------------------------------------------------------------

    def start_loads(self, loads: Iterable[PlannedLoad]) -> None:
        """Starts these loads; synchronous ones are placed before returning (see ``take_results``)."""
        if self._layout is None:
            return
        deadline = time.monotonic() + self._config.connector.load_timeout_s
        for spec in loads:
            job = LoadJob(
                request_id=spec.request_id,
                start=spec.start,
                end=spec.end,
                objects=list(spec.objects),
                deadline=deadline,
            )
            load = _Load(job, spec, time.perf_counter())
            self._counters.add("loads")
            if not spec.objects:
                job.error = "nothing to load"
                job.done = True
            elif self.fetcher.saturated:
                job.error = "every load thread is held by a stuck tier"
                job.done = True
            else:
                job.begin(self.fetcher)
            if spec.sync:
                self._run(load)
                self._finish(load)
            else:
                self._jobs[spec.request_id] = load

    def _run(self, load: _Load) -> None:
        """Places a synchronous load to its end (bounded by its deadline)."""
        job = load.job
        place = self._place_fn(load.spec)
        while not job.advance(place):
            self.fetcher.wakeup.clear()
            if job.ready():
                continue
            left = job.deadline - time.monotonic()
            self.fetcher.wakeup.wait(min(_SYNC_POLL_S, max(0.0, left)))

    def _place_fn(self, spec: PlannedLoad) -> PlaceFn:
        def place(
            blocks: Sequence[bytes | None], objects: Sequence[ObjectRef], lo: int, hi: int
        ) -> Placed:
            with self._metrics.time_stage("place"):
                return self._place(spec, blocks, objects, lo, hi)

        return place

    def _place(
        self,
        spec: PlannedLoad,
        blocks: Sequence[bytes | None],
        objects: Sequence[ObjectRef],
        lo: int,
        hi: int,
    ) -> Placed:
        """Decodes and scatters tokens ``[lo, hi)`` of ``objects``; stops at the first bad one."""
        layout, expect = self._layout, self.spec
        assert layout is not None and expect is not None
        placed_to, nbytes = lo, 0
        for block, obj in zip(blocks, objects, strict=True):
            a, b = max(placed_to, obj.start), min(hi, obj.end)
            if b <= a:
                continue
            where = f"object [{obj.start}, {obj.end})"
            if block is None:
                return Placed(placed_to - lo, nbytes, f"{where} is missing")
            try:
                decoded = decode_block(block, key=obj.key, expect=expect, verify=False)
            except CorruptBlockError as e:
                # NOTE: the store already checked checksums and keys and deleted what
                # failed; what is left here is a header that lies about its size or
                # layout (an lz4 size beyond the chunk): counted, recomputed.
                self._metrics.count_corrupt("load", e.reason)
                return Placed(placed_to - lo, nbytes, f"{where} is invalid: {e}")
            if decoded.header.num_tokens != obj.num_tokens:
                self._metrics.count_corrupt("load", "shape")
                return Placed(
                    placed_to - lo,
                    nbytes,
                    f"{where} holds {decoded.header.num_tokens} tokens, not {obj.num_tokens}",
                )
            window = slice(a - obj.start, b - obj.start)
            payload = decoded.payload[:, :, window]
            try:
                if decoded.scales is None:
                    layout.scatter(payload, spec.block_ids, a)
                elif not layout.scatter_quantized(
                    payload, decoded.scales[:, :, window], spec.block_ids, a
                ):
                    kv = dequantize_chunk(
                        payload, decoded.scales[:, :, window], decoded.header.kv_dtype
                    )
                    layout.scatter(kv, spec.block_ids, a)
            except KernelInputError as e:
                return Placed(placed_to - lo, nbytes, f"{where} does not fit the cache: {e}")
            nbytes += len(block)
            placed_to = b
        return Placed(placed_to - lo, nbytes)

    def _finish(self, load: _Load) -> None:
        """Counts an ended load; a short one is remembered as failed from its first unplaced token."""
        job, spec = load.job, load.spec
        seconds = time.perf_counter() - load.started
        self._counters.load_took(seconds)
        self._metrics.stage_latency.labels("load").observe(seconds)
        wanted = spec.end - spec.start
        self._counters.add("loaded_tokens", job.placed)
        self._counters.add("loaded_bytes", job.nbytes)
        self._metrics.load_tokens.labels("loaded").inc(job.placed)
        result = LoadResult(spec.request_id, spec.start, spec.end, job.placed)
        if job.placed < wanted:
            result = LoadResult(spec.request_id, spec.start, spec.end, job.placed, job.error)
            first_bad = spec.start + job.placed
            bs = self._layout.geometry.block_size if self._layout is not None else 1
            self._errors.update(spec.block_ids[first_bad // bs : math.ceil(spec.end / bs)])
            self._failed[spec.request_id] = first_bad
            self._new_failures[spec.request_id] = first_bad
            self._counters.add("load_failures")
            self._counters.add("failed_tokens", wanted - job.placed)
            self._metrics.load_tokens.labels("failed").inc(wanted - job.placed)
            self.last_errors = [
                *self.last_errors[1 - _LAST_ERRORS :],
                f"{spec.request_id}: {job.error}",
            ]
            log.info(
                "kvtier load for %s: %d of %d tokens (%s); the engine recomputes from token %d",
                spec.request_id,
                job.placed,
                wanted,
                job.error,
                (first_bad // bs) * bs,
            )
        self._results.append(result)

    def take_results(self) -> list[LoadResult]:
        """Loads that ended since the last call (synchronous ones included)."""
        results, self._results = self._results, []
        return results

    def take_load_errors(self) -> set[int]:
        """Blocks that failed to load since the last call (the engine recomputes them)."""
        errors, self._errors = self._errors, set()
        return errors

    def loads_ready(self) -> bool:
        """Whether an asynchronous load has something to place, or is past its deadline."""
        return any(load.job.ready() for load in self._jobs.values())

    @property
    def num_loading(self) -> int:
        """Asynchronous loads in flight."""
        return len(self._jobs)

    # ---- saves ---------------------------------------------------------------------------

    def save(self, saves: Iterable[PlannedSave]) -> None:
        """Gathers these saves out of the cache and queues them for the saver thread."""
        if self._layout is None:
            return
        for spec in saves:
            if spec.request_id in self._failed and not spec.after_failed_load:
                # computed on top of blocks a failed load never wrote: neither stored nor compared
                self._counters.add("dropped_saves", len(spec.objects))
            else:
                for obj in spec.objects:
                    self._save_object(spec, obj)
                for obj in spec.verify:
                    self._verify_object(spec, obj)
            if spec.release:
                self._released.add(spec.request_id)

    def _verify_object(self, spec: PlannedSave, obj: ObjectRef) -> None:
        """Hands what the engine computed for a stored object to the verifier (a copy)."""
        assert self._layout is not None and self.spec is not None
        if self._verifier is None:
            self._verifier = ChunkVerifier(
                self._store,
                spec=self.spec,
                quarantine=self._quarantine if self._quarantine is not None else Quarantine(),
                metrics=self._metrics,
                max_queue=self._config.connector.save_queue,
                fetch_timeout_s=self._config.connector.load_timeout_s,
                on_mismatch=self._found_bad,
            )
        try:
            chunk = self._layout.gather(spec.block_ids, obj.start, obj.num_tokens)
        except KernelInputError as e:
            log.warning("kvtier: cannot gather %s for verification: %s", spec.request_id, e)
            return
        if self._verifier.submit(obj.key, chunk.cpu()):
            self._counters.add("verify_chunks")

    def _found_bad(self, key: bytes) -> None:
        with self._bad_lock:
            self._bad_keys.append(key)

    @property
    def verifier(self) -> ChunkVerifier | None:
        """The verifier (once an object was handed to it)."""
        return self._verifier

    @property
    def verify_stats(self) -> VerifyStats:
        """What sampled verification found (all zero before it checked anything)."""
        return self._verifier.stats if self._verifier is not None else VerifyStats()

    @property
    def save_stats(self) -> SaveStats:
        """What the background saver did."""
        return self._saver.stats

    def _save_object(self, spec: PlannedSave, obj: ObjectRef) -> None:
        layout = self._layout
        assert layout is not None
        dtype = layout.geometry.dtype
        try:
            quantized = None
            if self._encoding != Encoding.RAW:
                quantized = layout.gather_quantized(
                    spec.block_ids, obj.start, obj.num_tokens, self._encoding
                )
            if quantized is not None:
                # a blocking copy: the saver thread must not see one still in flight
                queued = self._saver.submit(
                    obj.key, type(quantized)(quantized.data.cpu(), quantized.scales.cpu()), dtype
                )
            else:
                chunk = layout.gather(spec.block_ids, obj.start, obj.num_tokens)
                queued = self._saver.submit(obj.key, chunk.cpu(), dtype)
        except KernelInputError as e:
            log.warning(
                "kvtier: cannot gather %s [%d, %d): %s", spec.request_id, obj.start, obj.end, e
            )
            queued = False
        self._counters.add("saved_chunks" if queued else "dropped_saves")
        if queued and self.on_saved is not None:
            self.on_saved(obj.key)

    # ---- per step --------------------------------------------------------------------------

    def finished(self, finished_req_ids: Iterable[str] = ()) -> tuple[set[str], set[str]]:
        """Advances asynchronous loads; (requests whose last saves were gathered, loads that ended).

        A load of a request in ``finished_req_ids`` is abandoned, never placed
        (its blocks are about to be freed). The ``LoadResult`` of each load
        that ended is in ``take_results``.
        """
        finished = set(finished_req_ids)
        recent = self._recent_finished[1] | finished
        self._recent_finished = (self._recent_finished[1], finished)
        recvd = finished & self._jobs.keys()  # ended while loading: reported, never placed
        self.abandon(finished)
        for rid, load in list(self._jobs.items()):
            if load.job.advance(self._place_fn(load.spec)):
                del self._jobs[rid]
                self._finish(load)
                recvd.add(rid)
        sent = self._released & recent
        self._released -= sent
        return sent, recvd

    def abandon(self, request_ids: Iterable[str]) -> None:
        """These requests ended: their loads in flight are dropped, never placed (their blocks
        are about to be freed), and what was remembered of them is forgotten."""
        for rid in request_ids:
            load = self._jobs.pop(rid, None)
            if load is not None:
                load.job.abandon()
            self._failed.pop(rid, None)

    def report(self) -> WorkerReport | None:
        """Failed loads since the last report, bad keys, and the load threads' state when it changed."""
        stuck = self.fetcher.saturated
        with self._bad_lock:
            bad, self._bad_keys = tuple(self._bad_keys), []
        if not self._new_failures and stuck == self._reported_stuck and not bad:
            return None
        report = WorkerReport(self._new_failures, stuck, bad)
        self._new_failures = {}
        self._reported_stuck = stuck
        return report

    def flush(self, timeout: float = 30.0) -> bool:
        """Waits until every queued save has reached the store's tiers and every check ran."""
        deadline = time.monotonic() + timeout
        saved = self._saver.flush(timeout)
        if self._verifier is None:
            return saved
        return self._verifier.flush(max(0.0, deadline - time.monotonic())) and saved

    def close(self) -> None:
        """Abandons loads in flight, stores what is queued, stops the threads."""
        for load in self._jobs.values():
            load.job.abandon()
        self._jobs.clear()
        self._saver.close(timeout=30.0)
        if self._verifier is not None:
            self._verifier.close(timeout=30.0)
        if self._owns_fetcher:
            self.fetcher.shutdown()
