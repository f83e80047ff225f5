"""What a shared tier gains and loses, as a log a router follows (``GET /tier_events``).

The kvtier cache server records every block it stores (``stored``) and every
block that leaves it (``removed``: evicted for capacity from its last tier,
deleted, or deleted after a reader reported it bad). A router reads the log
with a cursor, as it reads an engine's ``/kv_events``, so its view of the
shared tier follows the tier instead of drifting (``docs/router.md``).

Each entry names a block twice: the *scoped* key the server stores it under
(a tenant's keys are scoped, ``kvtier.server.tenants``) and the client's key
(the content address an engine and a router compute). Readers see the
client's keys, filtered by a predicate on both (a tenant sees its own
slots' blocks only).

Bounded: a ring of the last ``capacity`` entries (one per key), and the last
``max_keys`` stored keys still held, for the snapshot a reader that fell
behind gets instead (``reset``).
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

TierEventKind = Literal["stored", "removed"]
Visible = Callable[[bytes, bytes], bool]
"""``visible(scoped_key, key)``: whether a reader may see this entry."""

MAX_WAIT_S = 30.0


@dataclass(frozen=True)
class TierEventPage:
    """One answer of :meth:`TierEventLog.read` (the JSON of ``GET /tier_events``).

    Attributes:
        log_id: This log (a restarted server is another one).
        reset: The reader's cursor is unknown here (another log, the future, or
            entries it missed left the ring): ``snapshot`` holds the keys held
            now instead of ``events``.
        last_seq: Pass as ``after`` next time.
        events: ``(seq of its last key, kind, keys)``: runs of one kind, oldest first.
        snapshot: With ``reset``: the stored keys still held (the newest ``max_keys``).
    """

    log_id: str
    reset: bool
    last_seq: int
    events: list[tuple[int, TierEventKind, list[bytes]]]
    snapshot: list[bytes] | None = None

    def to_json(self) -> dict[str, Any]:
        """The wire format: keys in hex (``docs/router.md``, Shared-tier events)."""
        out: dict[str, Any] = {
            "log_id": self.log_id,
            "reset": self.reset,
            "last_seq": self.last_seq,
            "events": [
                {"seq": seq, "type": kind, "keys": [k.hex() for k in keys]}
                for seq, kind, keys in self.events
            ],
        }
        if self.snapshot is not None:
            out["snapshot"] = {"stored": [k.hex() for k in self.snapshot]}
        return out


class TierEventLog:
    """Stored and removed keys of a tier, with sequence numbers (thread-safe).

    Args:
        capacity: Entries (one per key) kept for readers.
        max_keys: Held keys remembered for snapshots (oldest forgotten).
    """

    def __init__(self, capacity: int = 65_536, max_keys: int = 200_000) -> None:
        if capacity < 1 or max_keys < 1:
            raise ValueError("capacity and max_keys must be positive")
        self.log_id = uuid.uuid4().hex
        self._ring: deque[tuple[int, TierEventKind, bytes, bytes]] = deque(maxlen=capacity)
        self._held: OrderedDict[bytes, bytes] = OrderedDict()  # scoped -> key
        self._max_keys = max_keys
        self._seq = 0
        self._cond = threading.Condition()
        self.unnamed_evictions = 0

    @property
    def last_seq(self) -> int:
        """Sequence number of the newest entry (0 before any)."""
        with self._cond:
            return self._seq

    def record(self, kind: TierEventKind, pairs: Iterable[tuple[bytes, bytes]]) -> None:
        """Records ``(scoped_key, key)`` pairs of one kind and wakes waiting readers.

        Cheap and non-blocking beyond a lock: tiers call it from eviction listeners.
        """
        with self._cond:
            n = self._seq
            for scoped, key in pairs:
                n += 1
                self._ring.append((n, kind, bytes(scoped), bytes(key)))
                if kind == "stored":
                    self._held[bytes(scoped)] = bytes(key)
                    self._held.move_to_end(bytes(scoped))
                    if len(self._held) > self._max_keys:
                        self._held.popitem(last=False)
                else:
                    self._held.pop(bytes(scoped), None)
            if n != self._seq:
                self._seq = n
                self._cond.notify_all()

    def evicted(self, scoped: bytes) -> None:
        """A block left the tier, known by its scoped key only (a disk tier's eviction):
        recorded as ``removed`` under the client's key the log remembers from its
        ``stored`` entry; one it does not remember (older than ``max_keys``) is counted
        in ``unnamed_evictions`` and not reported."""
        with self._cond:
            key = self._held.get(bytes(scoped))
            if key is None:
                self.unnamed_evictions += 1
                return
        self.record("removed", [(scoped, key)])

    def read(
        self,
        after: int,
        log_id: str | None = None,
        limit: int = 4096,
        visible: Visible | None = None,
    ) -> TierEventPage:
        """Entries after ``after`` (at most ``limit`` looked at), or a snapshot when some
        are gone; ``visible`` filters what this reader may see."""
        with self._cond:
            first = self._ring[0][0] if self._ring else self._seq + 1
            known = log_id in (None, self.log_id) and 0 <= after <= self._seq
            if not known or after < first - 1:
                snap = [k for s, k in self._held.items() if visible is None or visible(s, k)]
                return TierEventPage(self.log_id, True, self._seq, [], snap)
            # NOTE: sequence numbers are consecutive, so the entries after ``after`` are the
            # ring's last ``seq - after``: no scan of the ones already read.
            start = len(self._ring) - (self._seq - after)
            entries = [self._ring[i] for i in range(start, min(len(self._ring), start + limit))]
        events: list[tuple[int, TierEventKind, list[bytes]]] = []
        for seq, kind, scoped, key in entries:
            if visible is not None and not visible(scoped, key):
                continue
            if events and events[-1][1] == kind:
                events[-1][2].append(key)
                events[-1] = (seq, kind, events[-1][2])
            else:
                events.append((seq, kind, [key]))
        last = entries[-1][0] if entries else after
        return TierEventPage(self.log_id, False, last, events)

    def wait(self, after: int, timeout_s: float) -> None:
        """Returns when an entry newer than ``after`` exists, or after ``timeout_s`` (at most
        ``MAX_WAIT_S``)."""
        with self._cond:
            self._cond.wait_for(lambda: self._seq > after, min(timeout_s, MAX_WAIT_S))


def parse_query(query: dict[str, list[str]]) -> tuple[int, str | None, float, int]:
    """``after``, ``log_id``, ``wait_s`` and ``limit`` of a ``/tier_events`` query.

    Raises:
        ValueError: for a value that is not a number, or out of range.
    """

    def one(name: str, default: str) -> str:
        return query.get(name, [default])[-1]

    after = int(one("after", "0"))
    wait_s = float(one("wait_s", "0"))
    limit = int(one("limit", "4096"))
    if after < 0 or not 0 <= wait_s <= MAX_WAIT_S or not 1 <= limit <= 65_536:
        raise ValueError("after >= 0, 0 <= wait_s <= 30, 1 <= limit <= 65536")
    log_id = query.get("log_id", [None])[-1]
    return after, log_id, wait_s, limit
