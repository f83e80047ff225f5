"""The save path: encode gathered chunks and put them, off the engine's thread.

The engine's step thread gathers a chunk out of the paged cache (a copy: the
slots may be reused once the request ends) and hands the tensor here. A
daemon thread quantizes (if configured), encodes and puts it into the store.
The queue is bounded: when it is full the chunk is dropped and counted, so a
slow store never stalls a forward pass.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from kvtier.block import Compression, Encoding, encode_block
from kvtier.connectors.queue_worker import QueueWorker
from kvtier.kernels import QuantizedChunk, quantize_chunk
from kvtier.metrics import StoreMetrics
from kvtier.store import TieredStore

log = logging.getLogger(__name__)


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


class ChunkSaver(QueueWorker[_Pending]):
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
        self.stats = SaveStats()
        super().__init__("kvtier-saver", max_queue)

    def submit(
        self, key: bytes, chunk: torch.Tensor | QuantizedChunk, kv_dtype: torch.dtype
    ) -> bool:
        """Queue a chunk: ``[L, 2, T, H, D]`` in ``kv_dtype``, or already quantized from it."""
        if self._offer(_Pending(key, chunk, kv_dtype)):
            return True
        self.stats.chunks_dropped += 1
        self._metrics.queue_dropped.labels("connector").inc()
        return False

    def flush(self, timeout: float) -> bool:
        """Wait until queued chunks are stored; ``False`` on timeout."""
        deadline = time.monotonic() + timeout
        if not self._drain(deadline):
            return False
        return self._store.flush(max(0.0, deadline - time.monotonic()))

    def encode(
        self, key: bytes, chunk: torch.Tensor | QuantizedChunk, kv_dtype: torch.dtype
    ) -> bytes:
        """One chunk as a block for ``key`` in the configured encoding."""
        if not isinstance(chunk, QuantizedChunk):
            if self._encoding == Encoding.RAW:
                return encode_block(chunk, key=key, compression=self._compression)
            chunk = quantize_chunk(chunk, self._encoding)
        return encode_block(
            chunk.data.cpu(),
            key=key,
            encoding=chunk.encoding,
            scales=chunk.scales.cpu(),
            kv_dtype=kv_dtype,
            compression=self._compression,
        )

    def _handle(self, item: _Pending) -> None:
        with self._metrics.time_stage("save"):
            block = self.encode(item.key, item.chunk, item.kv_dtype)
            self._store.put([(item.key, block)])
        self.stats.chunks_saved += 1
        self.stats.bytes_saved += len(block)

    def _failed(self, item: _Pending, error: Exception) -> None:
        self.stats.chunks_failed += 1
        log.warning("kvtier saver: could not save a chunk: %s", error)
