"""Small helpers shared by the core tests."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence

import torch

from kvtier.block import encode_block
from kvtier.tiers.base import Tier, TierUsage


def key(i: int) -> bytes:
    """A deterministic 16-byte key."""
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def block(i: int, tokens: int = 8, *, bound: bytes | None = None) -> bytes:
    """A small valid block whose content depends on ``i``, bound to ``bound`` (``key(i)``).

    A block carries the key it is stored under (``kvtier.block``): put it under that key.
    """
    g = torch.Generator().manual_seed(i)
    kv = torch.randn(2, 2, tokens, 2, 8, generator=g).to(torch.bfloat16)
    return encode_block(kv, key=key(i) if bound is None else bound)


class FlakyTier(Tier):
    """A dict-backed tier that can be made slow or failing, and does not verify reads.

    ``deadlines`` records ``(op, deadline, time left when called)`` of every read.
    """

    def __init__(self, name: str = "flaky", delay: float = 0.0) -> None:
        self.name = name
        self.delay = delay
        self.fail: BaseException | None = None
        self.data: dict[bytes, bytes] = {}
        self.calls: list[str] = []
        self.deadlines: list[tuple[str, float | None, float | None]] = []
        self._lock = threading.Lock()

    def _note(self, op: str, deadline: float | None) -> None:
        left = None if deadline is None else deadline - time.monotonic()
        self.deadlines.append((op, deadline, left))

    def _enter(self, op: str) -> None:
        self.calls.append(op)
        if self.delay:
            time.sleep(self.delay)
        if self.fail is not None:
            raise self.fail

    def contains(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[bool]:
        self._note("contains", deadline)
        self._enter("contains")
        with self._lock:
            return [k in self.data for k in keys]

    def get(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[bytes | None]:
        self._note("get", deadline)
        self._enter("get")
        with self._lock:
            return [self.data.get(k) for k in keys]

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        self._enter("put")
        with self._lock:
            for k, b in items:
                self.data[k] = b
        return [True] * len(items)

    def delete(self, keys: Sequence[bytes]) -> int:
        self._enter("delete")
        with self._lock:
            return sum(self.data.pop(k, None) is not None for k in keys)

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(sum(map(len, self.data.values())), None, len(self.data))


class StallingTier(FlakyTier):
    """A :class:`FlakyTier` whose reads hang once :meth:`stall` is called, like a paused server.

    Each read then waits up to ``stall_s`` seconds (it is counted in
    ``calls`` before it waits); :meth:`release` ends every hang at once and
    lets reads through again, so a test's server stops quickly.
    """

    def __init__(self, name: str = "stalling", stall_s: float = 10.0) -> None:
        super().__init__(name)
        self.stall_s = stall_s
        self._stalling = False
        self._free = 0
        self._released = threading.Event()

    def stall(self, after: int = 0) -> None:
        """Hang every read from now on, after letting ``after`` more through."""
        with self._lock:
            self._stalling, self._free = True, after
            self._released = threading.Event()

    def release(self) -> None:
        """End every hang now; reads go through until the next :meth:`stall`."""
        with self._lock:
            self._stalling = False
            released = self._released
        released.set()

    def _enter(self, op: str) -> None:
        super()._enter(op)
        if op not in ("get", "contains"):
            return
        with self._lock:
            if not self._stalling:
                return
            if self._free > 0:
                self._free -= 1
                return
            released = self._released
        released.wait(self.stall_s)
