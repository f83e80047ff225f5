"""Following vLLM engines' KV events (vLLM's ZMQ publisher) into the router's index.

vLLM publishes what its prefix cache (G1) gains and loses when started with
``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'``::

    PUB  multipart (topic, seq: 8-byte big-endian, payload)
         payload = msgpack [ts, [event, ...], data_parallel_rank]
         event   = {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None,
                    "token_ids": [...], "block_size": B, "medium": "GPU", ...}
                 | {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU"}
                 | {"type": "AllBlocksCleared"}
    ROUTER (replay) request (b"", start seq: 8 bytes) -> every buffered batch with seq >= start,
         each (b"", topic, seq, payload), then (b"", b"", -1, b"")

One task per engine reads the PUB socket; ``VllmBlockMap`` names each block
by the router's key (``vllm_blocks.py``), and the keys go into the
``PrefixIndex`` as the bundled engine's ``stored``/``evicted`` events do.

Sequence numbers: batch ``seq`` follows ``seq - 1``. A jump (the publisher
dropped batches past its high-water mark, or the router was away) is filled
from the replay socket when there is one; batches it cannot fill may have
removed blocks, so the engine's G1 is then forgotten (what later batches
store is learned again). A number going back means the engine restarted:
its G1 is forgotten too. An engine the health checks take out is forgotten
until it publishes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack
import zmq
import zmq.asyncio

from kvtier.keys import CacheNamespace
from kvtier.router.config import VllmEventSource
from kvtier.router.index import PrefixIndex
from kvtier.router.metrics import RouterMetrics
from kvtier.router.vllm_blocks import MapChanges, VllmBlockMap, VllmEventError

log = logging.getLogger(__name__)

END_SEQ = -1  # the replay socket's last message
REPLAY_TIMEOUT_S = 5.0


class NamespaceSink(Protocol):
    """Who is told each engine's key namespace (the router's ``EventFollower``)."""

    def set_namespace(self, url: str, namespace: CacheNamespace, block_size: int) -> None: ...


def decode_batch(payload: bytes) -> list[Any]:
    """The events of one published batch (``[ts, events, data_parallel_rank]``).

    Raises:
        VllmEventError: for bytes that are not a vLLM event batch.
    """
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise VllmEventError(f"a KV event batch that is not msgpack: {e}") from None
    if not isinstance(obj, list) or len(obj) < 2 or not isinstance(obj[1], list):
        raise VllmEventError("a KV event batch must be [ts, [events...], dp_rank]")
    return obj[1]


def parse_seq(raw: bytes) -> int:
    """A sequence number frame (8 bytes, big-endian; -1 ends a replay).

    Raises:
        VllmEventError: for another length.
    """
    if len(raw) != 8:
        raise VllmEventError(f"a sequence number is 8 bytes, got {len(raw)}")
    return int.from_bytes(raw, "big", signed=True)


@dataclass
class VllmStream:
    """Where the router is in one engine's event stream."""

    source: VllmEventSource
    map: VllmBlockMap
    next_seq: int | None = None  # None: nothing received since (re)start
    counts: dict[str, int] = field(default_factory=dict)  # for tests and logs


class VllmEventFollower:
    """Follows every configured vLLM engine's KV events on the router's loop.

    Args:
        sources: Where each engine publishes.
        index: Where the keys go.
        metrics: Counts applied keys, gaps, clears, skipped blocks.
        namespaces: Told each engine's namespace and block size once known.
        replay_timeout_s: Longest wait for the replay socket's answer.
        max_blocks: Blocks remembered per engine.
    """

    def __init__(
        self,
        sources: tuple[VllmEventSource, ...],
        index: PrefixIndex,
        metrics: RouterMetrics,
        namespaces: NamespaceSink,
        *,
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
        max_blocks: int = 1 << 20,
    ) -> None:
        self.streams = {
            s.engine: VllmStream(s, VllmBlockMap(s.namespace, max_blocks)) for s in sources
        }
        self._index = index
        self._metrics = metrics
        self._namespaces = namespaces
        self._replay_timeout_s = replay_timeout_s
        self._max_blocks = max_blocks
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False

    # ---- applying ---------------------------------------------------------------------------

    def _count(self, s: VllmStream, kind: str, n: int = 1) -> None:
        if n:
            s.counts[kind] = s.counts.get(kind, 0) + n
            self._metrics.kv_events.labels(s.source.engine, kind).inc(n)

    def forget(self, url: str, why: str) -> None:
        """What ``url`` holds is unknown (a gap, a restart, the engine taken out)."""
        s = self.streams.get(url)
        if s is None:
            return
        s.map.clear()
        self._index.forget(url)
        self._count(s, why)

    def engine_down(self, url: str) -> None:
        """An engine was taken out: forgotten until it publishes again."""
        s = self.streams.get(url)
        if s is not None:
            self.forget(url, "engine_down")
            s.next_seq = None

    def apply_payload(self, s: VllmStream, payload: bytes) -> None:
        """Applies one batch to the map and the index.

        Raises:
            VllmEventError: for a batch that is not vLLM's (the caller counts a gap).
        """
        url = s.source.engine
        had_namespace = s.map.namespace is not None
        try:
            changes: MapChanges = s.map.apply(decode_batch(payload))
        except VllmEventError:
            self._count(s, "malformed")
            raise
        if changes.cleared:
            self._index.reset(url, changes.stored, ())
            self._count(s, "cleared")
        else:
            self._index.stored(url, changes.stored)
            self._index.evicted(url, changes.evicted)
        self._count(s, "stored", len(changes.stored))
        self._count(s, "evicted", len(changes.evicted))
        self._count(s, "skipped", changes.skipped_blocks)
        if not had_namespace and s.map.namespace is not None and s.map.block_size is not None:
            self._namespaces.set_namespace(url, s.map.namespace, s.map.block_size)

    async def deliver(self, s: VllmStream, seq: int, payload: bytes) -> None:
        """One live batch: gaps filled (or the engine forgotten), then applied.

        NOTE: a replay fills only the batches before the live one that revealed the gap,
        and PUB/SUB delivers in order, so no live batch repeats a replayed one: a number
        going back is a restarted publisher.
        """
        joining = s.next_seq is None
        if s.next_seq is not None and seq < s.next_seq:
            self.forget(s.source.engine, "restart")
            joining = True
        if joining:  # what the replay socket still has comes first
            s.next_seq = 0 if s.source.replay_endpoint else seq
        assert s.next_seq is not None
        if seq > s.next_seq:
            await self._fill(s, s.next_seq, seq, joining)
        try:
            self.apply_payload(s, payload)
        except VllmEventError as e:
            log.warning("KV events of %s: batch %d dropped: %s", s.source.engine, seq, e)
            self.forget(s.source.engine, "gap")
        s.next_seq = seq + 1

    async def _fill(self, s: VllmStream, start: int, stop: int, joining: bool) -> None:
        """Applies batches ``[start, stop)`` from the replay socket; forgets the engine's G1
        when they are not all there (a removal among them would be missed), unless the
        router is only joining (it knew nothing of the engine: nothing to get wrong)."""
        batches: list[tuple[int, bytes]] = []
        if s.source.replay_endpoint:
            try:
                batches = await self.replay(s.source, start)
            except (VllmEventError, zmq.ZMQError, TimeoutError) as e:
                log.warning("KV event replay of %s failed: %s", s.source.engine, e)
        wanted = [(q, p) for q, p in batches if start <= q < stop]
        complete = [q for q, _ in wanted] == list(range(start, stop))
        if not complete:
            self.forget(s.source.engine, "joined_late" if joining else "gap")
        else:
            self._count(s, "replayed", len(wanted))
        for q, p in wanted:
            try:
                self.apply_payload(s, p)
            except VllmEventError as e:
                log.warning("KV events of %s: replayed batch %d dropped: %s", s.source.engine, q, e)
                self.forget(s.source.engine, "gap")

    async def replay(self, source: VllmEventSource, start: int) -> list[tuple[int, bytes]]:
        """Every batch the publisher still buffers from ``start`` on, in order.

        Raises:
            TimeoutError: when the answer is not complete within the replay timeout.
            VllmEventError: for an answer that is not the publisher's.
            zmq.ZMQError: for a socket error.
        """
        assert source.replay_endpoint is not None
        ctx = self._context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            sock.connect(source.replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(self._replay_timeout_s):
                while True:
                    frames = await sock.recv_multipart()
                    if len(frames) != 4:
                        raise VllmEventError(f"a replay message of {len(frames)} frames")
                    seq = parse_seq(frames[2])
                    if seq == END_SEQ:
                        return out
                    out.append((seq, frames[3]))
        finally:
            sock.close(linger=0)

    # ---- the tasks -------------------------------------------------------------------------

    def _context(self) -> zmq.asyncio.Context:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        return self._ctx

    async def _follow(self, s: VllmStream) -> None:
        sock = self._context().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, s.source.topic.encode())
        sock.connect(s.source.endpoint)
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    if len(frames) != 3:
                        raise VllmEventError(f"a KV event message of {len(frames)} frames")
                    seq = parse_seq(frames[1])
                except VllmEventError as e:
                    log.warning("KV events of %s: %s", s.source.engine, e)
                    self._count(s, "malformed")
                    continue
                await self.deliver(s, seq, frames[2])
        finally:
            sock.close(linger=0)

    def start(self) -> None:
        """Starts one subscriber task per engine (call on the serving loop)."""
        if not self._started:
            self._started = True
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._follow(s)) for s in self.streams.values()]

    def add(self, source: VllmEventSource) -> None:
        """Follows one more engine (it joined at runtime, ``POST /engines``); on the serving
        loop. What its replay socket still buffers is applied first, as for a late joiner.

        Raises:
            ValueError: if its events are followed already.
        """
        if source.engine in self.streams:
            raise ValueError(f"the KV events of {source.engine} are followed already")
        s = self.streams[source.engine] = VllmStream(
            source, VllmBlockMap(source.namespace, self._max_blocks)
        )
        if self._started:
            self._tasks.append(asyncio.get_running_loop().create_task(self._follow(s)))

    async def stop(self) -> None:
        """Stops following and closes the sockets."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        self._started = False
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
