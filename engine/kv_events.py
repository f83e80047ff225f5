"""KV events: which prefixes an engine holds, published so a router can send requests there.

Four kinds of event, each a batch of 16-byte keys (``kvtier.keys``):

* ``stored``: full blocks registered in the engine's prefix cache (G1);
* ``evicted``: G1 blocks whose KV was overwritten (the block was handed out again);
* ``saved``: objects the kvtier connector queued for the shared tier;
* ``unsaved``: objects the connector's store evicted from its last tier for
  capacity (a CPU pool or a disk directory this process evicts from; a
  remote tier's evictions come from the cache server, ``/tier_events``).

NOTE: the keys are kvtier's content addresses: a G1 block ending at token
``e`` is named by the key of the prefix it ends, the key a tier object ending
at ``e`` would have, so a router computes one set of keys from a prompt and
compares them with every engine's G1 and with the shared tier alike
(``docs/router.md``). They are the request's own keys
(``Request.prefix_keys``), which G1 is keyed by too: nothing is hashed here.

Who runs where::

    engine-core process (step thread)              API process
    ---------------------------------              -----------
    BlockManager ─stored/evicted─►                 reader thread ─► KvEventLog.append
    KvtierConnector ─saved─► KvEventRecorder       (a sequence number per batch, a ring
    publish(): recorder.drain() ─► StepOutputs ─►   of recent batches, the live key set)
                                                   GET /kv_events?after=N ─► KvEventLog.read
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Literal

from kvtier.keys import CacheNamespace

EventKind = Literal["stored", "evicted", "saved", "unsaved"]
KINDS: tuple[EventKind, ...] = ("stored", "evicted", "saved", "unsaved")
MAX_UNSAVED = 65_536  # tier evictions held between two drains (the oldest dropped)


@dataclass(frozen=True)
class KvEvent:
    """One batch of keys of one kind, in the order the engine produced them."""

    kind: EventKind
    keys: tuple[bytes, ...]


class KvEventRecorder:
    """Turns block-manager and connector callbacks into key events (engine-core process).

    Not thread-safe: every callback comes from the engine's step thread
    (the connector's saves are queued there too).

    Args:
        namespace: The namespace of the engine's keys (its block manager's).
    """

    def __init__(self, namespace: CacheNamespace) -> None:
        self.namespace = namespace
        self._block_key: dict[int, bytes] = {}  # G1 block id -> its key
        self._pending: list[tuple[EventKind, bytes]] = []
        # NOTE: filled by the store's writer threads (deque appends are atomic), drained
        # on the step thread after the step's own events: a key saved and evicted
        # in between is reported gone (the direction in which a router errs harmlessly).
        self._unsaved: deque[bytes] = deque(maxlen=MAX_UNSAVED)

    # ---- block manager callbacks ----------------------------------------------------------

    def stored(self, key: bytes, block_id: int) -> None:
        """A block was registered in G1 under ``key`` (the key of the prefix it ends)."""
        self._block_key[block_id] = key
        self._pending.append(("stored", key))

    def evicted(self, block_id: int) -> None:
        """A G1 block is handed out again: its prefix is gone."""
        key = self._block_key.pop(block_id, None)
        if key is not None:
            self._pending.append(("evicted", key))

    # ---- connector callback ------------------------------------------------------------------

    def saved(self, key: bytes) -> None:
        """The connector queued the object ``key`` for the shared tier."""
        self._pending.append(("saved", bytes(key)))

    def unsaved(self, key: bytes) -> None:
        """The connector's store evicted the object ``key`` (any thread)."""
        self._unsaved.append(bytes(key))

    def drain(self) -> list[KvEvent]:
        """The events since the last call, consecutive ones of a kind in one batch."""
        while self._unsaved:
            self._pending.append(("unsaved", self._unsaved.popleft()))
        out: list[KvEvent] = []
        run: list[bytes] = []
        kind: EventKind | None = None
        for k, key in self._pending:
            if k != kind and run:
                assert kind is not None
                out.append(KvEvent(kind, tuple(run)))
                run = []
            kind = k
            run.append(key)
        if run and kind is not None:
            out.append(KvEvent(kind, tuple(run)))
        self._pending = []
        return out


@dataclass(frozen=True)
class KvEventPage:
    """What ``KvEventLog.read`` answers (the JSON body of ``GET /kv_events``).

    Attributes:
        reset: The reader's cursor is unknown to this log (another engine run,
            or events it missed were dropped from the ring): ``snapshot`` holds
            the whole state instead of ``events``.
        last_seq: The sequence number to pass as ``after`` next time.
        events: ``(seq, kind, keys)`` after the reader's cursor, oldest first.
        snapshot: With ``reset``, every key held now, by kind (``stored``, ``saved``).
    """

    engine_id: str
    reset: bool
    last_seq: int
    events: list[tuple[int, EventKind, tuple[bytes, ...]]]
    snapshot: dict[str, list[bytes]] | None = None

    def to_json(self, namespace: CacheNamespace | None, block_size: int) -> dict[str, Any]:
        """The wire format (keys in hex); see ``docs/router.md``."""
        out: dict[str, Any] = {
            "engine_id": self.engine_id,
            "namespace": namespace.to_json() if namespace is not None else None,
            "block_size": block_size,
            "reset": self.reset,
            "last_seq": self.last_seq,
            "events": [
                {"seq": seq, "type": kind, "keys": [k.hex() for k in keys]}
                for seq, kind, keys in self.events
            ],
        }
        if self.snapshot is not None:
            out["snapshot"] = {
                kind: [k.hex() for k in keys] for kind, keys in self.snapshot.items()
            }
        return out


class KvEventLog:
    """The API process's record of an engine's KV events (thread-safe).

    The reader thread appends each step's batches; HTTP handlers read them
    with a cursor. Recent batches are kept in a ring of ``capacity``; the
    keys held now (G1's, and the last ``max_saved_keys`` saved ones: the
    shared tier's evictions are not reported) are kept whole so a reader
    that fell behind gets a snapshot.

    Args:
        capacity: Batches kept for readers.
        max_saved_keys: Saved keys remembered for snapshots (oldest dropped).
    """

    def __init__(self, capacity: int = 4096, max_saved_keys: int = 200_000) -> None:
        if capacity < 1 or max_saved_keys < 1:
            raise ValueError("capacity and max_saved_keys must be positive")
        self.engine_id = uuid.uuid4().hex
        self._ring: deque[tuple[int, EventKind, tuple[bytes, ...]]] = deque(maxlen=capacity)
        self._seq = 0
        self._stored: set[bytes] = set()
        self._saved: OrderedDict[bytes, None] = OrderedDict()
        self._max_saved = max_saved_keys
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    @property
    def last_seq(self) -> int:
        """Sequence number of the newest batch (0 before any)."""
        with self._lock:
            return self._seq

    def append(self, events: list[KvEvent]) -> None:
        """Records one step's batches and wakes waiting readers."""
        if not events:
            return
        with self._lock:
            for e in events:
                self._seq += 1
                self._ring.append((self._seq, e.kind, e.keys))
                if e.kind == "stored":
                    self._stored.update(e.keys)
                elif e.kind == "evicted":
                    self._stored.difference_update(e.keys)
                elif e.kind == "unsaved":
                    for k in e.keys:
                        self._saved.pop(k, None)
                else:
                    for k in e.keys:
                        self._saved[k] = None
                        self._saved.move_to_end(k)
                    while len(self._saved) > self._max_saved:
                        self._saved.popitem(last=False)
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            with contextlib.suppress(RuntimeError):  # that loop is closed
                loop.call_soon_threadsafe(_wake, fut)

    def read(self, after: int, engine_id: str | None = None, limit: int = 1024) -> KvEventPage:
        """Batches after ``after`` (at most ``limit``), or a snapshot when they are not all here."""
        with self._lock:
            first = self._ring[0][0] if self._ring else self._seq + 1
            known = engine_id in (None, self.engine_id) and 0 <= after <= self._seq
            if not known or after < first - 1:
                snapshot = {"stored": list(self._stored), "saved": list(self._saved)}
                return KvEventPage(self.engine_id, True, self._seq, [], snapshot)
            events = [e for e in self._ring if e[0] > after][:limit]
            last = events[-1][0] if events else after
            return KvEventPage(self.engine_id, False, last, events)

    async def wait(self, after: int, timeout_s: float) -> None:
        """Returns when a batch newer than ``after`` exists, or after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._seq > after:
                return
            self._waiters.append((loop, fut))
        try:
            await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            pass
        finally:
            with self._lock:
                if (loop, fut) in self._waiters:
                    self._waiters.remove((loop, fut))


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def attach_recorder(engine: Any) -> KvEventRecorder:
    """Hooks a recorder into an ``LLMEngine``'s block manager and (if it has the hook) its
    connector's saves; returns it (the caller drains it after every step)."""
    recorder = KvEventRecorder(engine.block_manager.namespace)
    engine.block_manager.listener = recorder
    if hasattr(engine.connector, "on_saved"):
        engine.connector.on_saved = recorder.saved
    if hasattr(engine.connector, "on_evicted"):
        engine.connector.on_evicted = recorder.unsaved
    return recorder
