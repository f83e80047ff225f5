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


def block(i: int, tokens: int = 8) -> bytes:
    """A small valid block whose content depends on ``i``."""
    g = torch.Generator().manual_seed(i)
    return encode_block(torch.randn(2, 2, tokens, 2, 8, generator=g).to(torch.bfloat16))


class FlakyTier(Tier):
    """A dict-backed tier that can be made slow or failing, and does not verify reads."""

    def __init__(self, name: str = "flaky", delay: float = 0.0) -> None:
        self.name = name
        self.delay = delay
        self.fail: BaseException | None = None
        self.data: dict[bytes, bytes] = {}
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def _enter(self, op: str) -> None:
        self.calls.append(op)
        if self.delay:
            time.sleep(self.delay)
        if self.fail is not None:
            raise self.fail

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self._enter("contains")
        with self._lock:
            return [k in self.data for k in keys]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
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
