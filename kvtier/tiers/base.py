"""The tier interface: a store of opaque encoded blocks addressed by key.

Every tier — in-process CPU memory, local disk, Aerospike, the kvtier cache
server — implements :class:`Tier`. The interface is batch-first: each call
takes many keys, so a network tier can answer in one round trip.

Contract shared by every implementation:

* **Keys** are 16-byte :data:`~kvtier.keys.ChunkKey` values. **Blocks** are
  ``bytes`` (an encoded block, see :mod:`kvtier.block`). A tier does not
  interpret blocks, except that a tier may verify them on read (then
  :attr:`Tier.verifies_reads` is true) and treat a bad one as a miss.
* **Ownership.** ``put`` takes ownership of the ``bytes`` it is given (they
  are immutable; a tier may keep a reference instead of copying). ``get``
  returns ``bytes`` the caller owns and may keep.
* **Misses are values.** ``get`` returns ``None`` for a key it does not have,
  ``contains`` returns ``False``; neither raises for a miss. ``put`` returns,
  per item, whether the tier now holds it (``False``: dropped — too large,
  disk full, stop-writes — never an exception).
* **Errors that may escape** are :class:`~kvtier.errors.TransientError`
  (a network tier timed out, lost its connection, or its circuit breaker is
  open) and :class:`~kvtier.errors.ConfigError` (the tier is misconfigured).
  Local tiers raise neither in normal operation. Callers (the
  :class:`~kvtier.store.TieredStore`) turn both into misses and count them.
* **Deadlines.** ``get``, ``contains`` and ``prefix_length`` take an
  optional ``deadline``: a :func:`time.monotonic` instant by which the call
  returns, retries, backoffs, every round trip of a multi-record block and
  every chunk of a stream included. A tier returns or raises no later than
  ``deadline`` plus a small slack, which each tier documents (about one
  socket poll for network tiers; one file read for the disk tier). At
  expiry a tier either

  - returns what it read in time with misses (``None`` / ``False``) for the
    rest — a tier that reads key by key (the disk tier); or
  - raises :class:`~kvtier.errors.TransientError` — a network tier, whose
    batch is one exchange: the timeout of the attempt that was cut short,
    or :class:`~kvtier.errors.DeadlineExceededError` if no attempt could
    start (a deadline already past: at once, without I/O).

  Callers treat both as misses. ``None`` (the default) keeps the tier's
  configured timeouts and retries. A deadline never lengthens a call:
  each attempt is bounded by the smaller of its configured timeout and
  what is left. In-process memory tiers ignore it. Writes take no deadline.
* **Thread safety.** Every method may be called from any thread
  concurrently; implementations lock internally.
* **Capacity.** A tier with a capacity never holds more than it; it evicts
  (per its policy) to make room and reports each eviction to its listener.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

EvictionListener = Callable[[bytes, bytes], None]
"""Called with ``(key, block)`` for each block a tier evicts to make room.

It runs on the evicting thread, possibly under the tier's lock: it must be
quick, must not block and must not call back into the tier.
"""

EvictedKeyListener = Callable[[bytes], None]
"""Called with the key of each block a tier evicts to make room, without the
block (a disk tier then reads nothing); same rules as :data:`EvictionListener`."""


@dataclass(frozen=True)
class TierUsage:
    """How full a tier is."""

    used_bytes: int
    capacity_bytes: int | None  # None: the tier does not know (e.g. a remote cluster)
    num_blocks: int | None


class Tier(abc.ABC):
    """A store of encoded blocks by key. See the module docstring for the contract."""

    name: str = "tier"
    """Label used in metrics and logs; unique within one store."""

    fast: bool = False
    """True if calls cost about a memory copy (in-process memory). The store
    calls a fast top tier on the caller's thread; any other tier only from
    background writers or for reads."""

    verifies_reads: bool = False
    """True if ``get`` only ever returns blocks that passed
    :func:`kvtier.block.verify_block` (or that were verified before they were
    stored, as in the CPU tier). Otherwise the store verifies them."""

    @abc.abstractmethod
    def contains(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[bool]:
        """Whether each key is present. Does not refresh recency.

        ``deadline``: a :func:`time.monotonic` instant; see the module docstring.
        """

    @abc.abstractmethod
    def get(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[bytes | None]:
        """The block for each key, or ``None`` for a miss. Refreshes recency of hits.

        ``deadline``: a :func:`time.monotonic` instant; see the module docstring.
        """

    @abc.abstractmethod
    def put(self, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        """Store ``(key, block)`` pairs; per item, whether the tier now holds it.

        Writing a key that exists is harmless (same key ⇒ same content); a
        tier may skip the write.
        """

    @abc.abstractmethod
    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove the keys that are present; returns how many were removed."""

    def report_bad(self, keys: Sequence[bytes]) -> int:
        """Remove blocks found wrong (corrupt, or failing verification); how many were removed.

        A tier shared through a server tells it why (the cache server deletes
        the block even for a reader and counts it against its writer); the
        default is :meth:`delete`.
        """
        return self.delete(keys)

    @abc.abstractmethod
    def usage(self) -> TierUsage:
        """Bytes used, capacity and block count."""

    def prefix_length(self, keys: Sequence[bytes], *, deadline: float | None = None) -> int:
        """How many leading keys are present (stops at the first miss); ``deadline`` as for ``contains``."""
        # NOTE: no keyword without a deadline, so a tier written before deadlines keeps working.
        found = self.contains(keys) if deadline is None else self.contains(keys, deadline=deadline)
        n = 0
        for present in found:
            if not present:
                break
            n += 1
        return n

    def set_eviction_listener(self, listener: EvictionListener | None) -> None:  # noqa: B027
        """Be told of every block evicted for capacity (tiers that never evict ignore it)."""

    def set_evicted_key_listener(self, listener: EvictedKeyListener | None) -> None:  # noqa: B027
        """Be told the key of every block evicted for capacity (tiers that never evict, or
        do not see their evictions, ignore it). Independent of :meth:`set_eviction_listener`."""

    def check_integrity(self) -> None:  # noqa: B027
        """Raise ``AssertionError`` if internal bookkeeping is inconsistent.

        Called by mutation tests after every operation; cheap enough for tests,
        not meant for the serving path. Remote tiers may do nothing.
        """

    def close(self) -> None:  # noqa: B027
        """Release resources. Further calls have undefined results."""
