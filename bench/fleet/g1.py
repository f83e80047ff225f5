"""An engine's own KV memory (G1) as the simulation sees it: blocks, references, LRU.

Mirrors ``engine/block_manager.py`` at the level the fleet cares about:

* a block that is full and computed carries its chain key and can be hit by
  any later request on this engine;
* blocks referenced by running requests are pinned; unreferenced keyed
  blocks stay cached in an LRU and are evicted only when space is needed;
* a request releases its blocks tail first, so its head (the part most
  likely shared) is the most recently used;
* a block a request computed while an equal one was already cached stays
  private to it (two copies, one key), as the real block manager does.

Capacity accounting, in blocks::

    pinned (len(refs)) + cached-unreferenced (len(lru)) + reserved <= capacity

``reserved`` counts blocks held by requests that carry no key (yet): the part
of a prompt not computed, the answer, a partial last block.

Every key that becomes cached or stops being cached is reported to
``on_stored`` / ``on_evicted``: these are the engine's KV events, from which
the router learns what each engine holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

KeyListener = Callable[[int], None]


class G1Cache:
    """Blocks of one engine. Not thread-safe (the simulation is single-threaded)."""

    def __init__(
        self,
        capacity_blocks: int,
        on_stored: KeyListener | None = None,
        on_evicted: KeyListener | None = None,
    ) -> None:
        if capacity_blocks < 2:
            raise ValueError("capacity_blocks must be >= 2")
        self.capacity = capacity_blocks
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.refs: dict[int, int] = {}
        self.reserved = 0
        self.on_stored = on_stored
        self.on_evicted = on_evicted
        self.evictions = 0

    def contains(self, key: int) -> bool:
        """True when a block with this key is cached (pinned or not)."""
        return key in self.refs or key in self.lru

    def match(self, keys: Sequence[int], limit: int) -> int:
        """Leading keys of ``keys[:limit]`` that are cached (prefix semantics)."""
        n = 0
        refs, lru = self.refs, self.lru
        for key in keys[:limit]:
            if key not in refs and key not in lru:
                break
            n += 1
        return n

    def can_allocate(self, hits: Sequence[int], total_blocks: int) -> bool:
        """True when a request that hits ``hits`` and needs ``total_blocks`` fits now."""
        need = total_blocks - len(hits)
        free = self.capacity - len(self.refs) - len(self.lru) - self.reserved
        evictable = len(self.lru) - sum(1 for k in hits if k in self.lru)
        return need <= free + evictable

    def allocate(self, hits: Sequence[int], total_blocks: int) -> None:
        """Pins ``hits`` and reserves the other blocks, evicting LRU blocks as needed.

        Raises:
            RuntimeError: if it does not fit (call :meth:`can_allocate` first).
        """
        if not self.can_allocate(hits, total_blocks):
            raise RuntimeError("allocate() without room: call can_allocate() first")
        for k in hits:
            if k in self.lru:
                del self.lru[k]
            self.refs[k] = self.refs.get(k, 0) + 1
        need = total_blocks - len(hits)
        free = self.capacity - len(self.refs) - len(self.lru) - self.reserved
        while free < need:
            victim, _ = self.lru.popitem(last=False)
            self.evictions += 1
            if self.on_evicted is not None:
                self.on_evicted(victim)
            free += 1
        self.reserved += need

    def register(self, key: int) -> bool:
        """A reserved block was computed (or loaded) and now carries ``key``.

        Returns:
            True when it became the cached block of that key (pinned by its
            request, which must then hold it); False when that key was already
            cached, so this block stays a private copy.
        """
        if key in self.refs or key in self.lru:
            return False
        self.refs[key] = 1
        self.reserved -= 1
        if self.on_stored is not None:
            self.on_stored(key)
        return True

    def release(self, held: Sequence[int], private_blocks: int) -> None:
        """A request ends: unpin ``held`` (tail first) and free its private blocks."""
        for k in reversed(held):
            n = self.refs[k] - 1
            if n:
                self.refs[k] = n
            else:
                del self.refs[k]
                self.lru[k] = None
        self.reserved -= private_blocks

    def check_integrity(self) -> None:
        """Asserts the accounting invariants (tests call it)."""
        assert self.reserved >= 0, self.reserved
        assert all(v > 0 for v in self.refs.values())
        assert not (self.refs.keys() & self.lru.keys())
        assert len(self.refs) + len(self.lru) + self.reserved <= self.capacity
