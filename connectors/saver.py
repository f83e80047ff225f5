"""The save path: encode gathered chunks and put them, off the engine's thread.

The engine's step thread gathers a chunk out of the paged cache (a copy: the
slots may be reused once the request ends) and hands the tensor here. A
daemon thread quantizes (if configured), encodes and puts it into the store.
The queue is bounded: when it is full the chunk is dropped and counted, so a
slow store never stalls a forward pass.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from kvtier.block import Compression, Encoding, encode_block
from kvtier.errors import KvtierError
from kvtier.kernels import QuantizedChunk, quantize_chunk
from kvtier.metrics import StoreMetrics
from kvtier.store import TieredStore
from kvtier.writer import close_at_exit, lower_thread_priority

log = logging.getLogger(__name__)

_STOP = object()


@dataclass(frozen=True)
class _Pending:
    key: bytes
    chunk: torch.Tensor | QuantizedChunk
    kv_dtype: torch.dtype


@dataclass
class SaveStats:
    """What the saver did."""

    chunks_saved: int = 0
    bytes_saved: int = 0
    chunks_dropped: int = 0
    chunks_failed: int = 0


class ChunkSaver:
    """Encodes and stores chunks from a background thread.

    Args:
        store: Destination.
        encoding: ``raw``, ``int8`` or ``fp8_e4m3``.
        compression: Block compression.
        max_queue: Chunks that may wait; more are dropped.
        metrics: Stage latency and drop counts.
    """

    def __init__(
        self,
        store: TieredStore,
        *,
        encoding: Encoding,
        compression: Compression,
        max_queue: int,
        metrics: StoreMetrics,
    ) -> None:
        self._store = store
        self._encoding = encoding
        self._compression = compression
        self._metrics = metrics
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queue)
        self.stats = SaveStats()
        self._thread = threading.Thread(target=self._run, name="kvtier-saver", daemon=True)
        self._thread.start()
        self._closed = False
        close_at_exit(self, timeout=30.0)

    def submit(
        self, key: bytes, chunk: torch.Tensor | QuantizedChunk, kv_dtype: torch.dtype
    ) -> bool:
        """Queue a chunk: ``[L, 2, T, H, D]`` in ``kv_dtype``, or already quantized from it."""
        try:
            self._queue.put_nowait(_Pending(key, chunk, kv_dtype))
            return True
        except queue.Full:
            self.stats.chunks_dropped += 1
            self._metrics.queue_dropped.labels("connector").inc()
            return False

    def flush(self, timeout: float) -> bool:
        """Wait until queued chunks are stored; ``False`` on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
        return self._store.flush(max(0.0, deadline - time.monotonic()))

    def close(self, timeout: float) -> None:
        """Store what is queued (up to ``timeout``), then stop the thread."""
        if self._closed:
            return
        self._closed = True
        self.flush(timeout)
        try:
            self._queue.put(_STOP, timeout=1.0)
        except queue.Full:
            log.warning("kvtier saver: queue still full at shutdown; abandoning it")
            return
        self._thread.join(timeout=5.0)

    def encode(
        self, key: bytes, chunk: torch.Tensor | QuantizedChunk, kv_dtype: torch.dtype
    ) -> bytes:
        """One chunk as a block for ``key`` in the configured encoding."""
        if not isinstance(chunk, QuantizedChunk):
            if self._encoding == Encoding.RAW:
                return encode_block(chunk, key=key, compression=self._compression)
            chunk = quantize_chunk(chunk, self._encoding.label)
        return encode_block(
            chunk.data.cpu(),
            key=key,
            encoding=Encoding.parse(chunk.encoding),
            scales=chunk.scales.cpu(),
            kv_dtype=kv_dtype,
            compression=self._compression,
        )

    def _run(self) -> None:
        lower_thread_priority()  # encoding must not slow the forward pass down
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                assert isinstance(item, _Pending)
                key, chunk, kv_dtype = item.key, item.chunk, item.kv_dtype
                with self._metrics.time_stage("save"):
                    block = self.encode(key, chunk, kv_dtype)
                    self._store.put([(key, block)])
                self.stats.chunks_saved += 1
                self.stats.bytes_saved += len(block)
            except (KvtierError, ValueError, RuntimeError) as e:
                self.stats.chunks_failed += 1
                log.warning("kvtier saver: could not save a chunk: %s", e)
            finally:
                self._queue.task_done()
