"""TieredStore: tiers composed top-down, with lookup, promotion and a write policy.

::

    tier 0 (fastest, e.g. CPU) ── tier 1 (disk) ── tier 2 (Aerospike / server)
       ▲ put (caller's thread if fast)   ▲ background writer   ▲ background writer
       └──── promotion of hits from lower tiers ─────────────────┘

* ``lookup(keys)``: how many leading keys are present in *any* tier.
* ``get(keys)``: blocks top-down; a hit in a lower tier is verified (unless
  that tier verifies itself) and promoted into every tier above it. Every
  hit, from any tier, must carry the key it was read for (the block header
  binds it, :mod:`kvtier.block`): a block of another key is corrupt.
* ``put(items)``: the write policy decides where blocks go:

  ========================  ===============================================
  ``write_through``         every tier (tier 0 now, the others in background)
  ``write_back``            tier 0; a block evicted from tier i is written to
                            tier i+1 (and tier 0 is written down on close)
  ``selective``             tier 0; written to the lower tiers once it has
                            been read ``selective_hits`` times
  ========================  ===============================================

Failures of a tier never escape: a :class:`~kvtier.errors.KvtierError` from a
tier (timeout, open breaker, misconfiguration) is counted and treated as a
miss for that tier; a corrupt block (a block of another key included) is
counted by reason, deleted from the tier that returned it (``Tier.report_bad``:
a shared tier is told why) and treated as a miss there: the tiers below still
get their chance. ``block_check``, if set, is one more check of blocks read
from tiers that do not verify their own reads (the cache server checks its
provenance stamps there).

Deadlines: ``lookup``, ``contains``, ``get`` and ``get_prefix`` take an
optional ``deadline`` (a :func:`time.monotonic` instant) for the whole call
and hand the same instant to each tier in turn, so a lower tier gets what
the tiers above left of it. A tier that runs out of time answers misses or
raises a :class:`~kvtier.errors.TransientError` (see
:mod:`kvtier.tiers.base`); either way those keys are misses here, and the
call returns within the slowest tier's slack after the deadline. Hits are
still promoted after a late call: promotion goes to a fast tier 0 or to
background writers, never waits on a slow tier.
"""

from __future__ import annotations

import enum
import functools
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvtier.block import check_key, read_header, verify_block
from kvtier.errors import (
    ConfigError,
    CorruptBlockError,
    KvtierError,
    TierUnavailableError,
    TransientError,
)
from kvtier.metrics import StoreMetrics
from kvtier.tiers.base import Tier, TierUsage
from kvtier.tiers.cpu import CpuTier
from kvtier.writer import BackgroundWriter

log = logging.getLogger(__name__)

_MAX_TRACKED_HITS = 1 << 16


class WritePolicy(enum.StrEnum):
    """Where ``put`` sends blocks; see the module docstring."""

    WRITE_THROUGH = "write_through"
    WRITE_BACK = "write_back"
    SELECTIVE = "selective"


def _used_bytes_of(tier: Tier) -> Callable[[], float]:
    def used() -> float:
        try:
            return float(tier.usage().used_bytes)
        except KvtierError:
            return float("nan")  # a network tier that cannot say right now

    return used


def _capacity_of(tier: Tier) -> int | None:
    try:
        return tier.usage().capacity_bytes
    except KvtierError as e:
        log.warning("tier %s: usage unavailable at start: %s", tier.name, e)
        return None


def _error_kind(e: KvtierError) -> str:
    if isinstance(e, TierUnavailableError):
        return "unavailable"
    if isinstance(e, TransientError):
        return "transient"
    if isinstance(e, ConfigError):
        return "config"
    return "other"


class TieredStore:
    """Tiers in order, fastest first.

    Args:
        tiers: At least one; names must be unique.
        write_policy: See :class:`WritePolicy`.
        selective_hits: Reads before a block is written down (``selective``).
        writer_queue: Blocks each background writer may hold before dropping.
        flush_on_close: With ``write_back``, write tier 0's blocks down on close.
        metrics: Where to count; a private registry if ``None``.

    Thread-safe: every method may be called from any thread.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH,
        selective_hits: int = 2,
        writer_queue: int = 1024,
        flush_on_close: bool = True,
        metrics: StoreMetrics | None = None,
    ) -> None:
        if not tiers:
            raise ConfigError("a TieredStore needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be unique, got {names}")
        if selective_hits < 1:
            raise ConfigError(f"selective_hits must be at least 1, got {selective_hits}")
        self.tiers = list(tiers)
        self.write_policy = WritePolicy(write_policy)
        self.selective_hits = selective_hits
        self.flush_on_close = flush_on_close
        self.metrics = metrics if metrics is not None else StoreMetrics()
        self._hits: OrderedDict[bytes, int] = OrderedDict()
        self._closed = False
        self.put_wait_s = 0.0
        """How long :meth:`put` waits for room in a background writer's queue before that
        tier's write is dropped (0: never waits; the cache server waits, so a flood of puts
        slows its senders instead of dropping writes it has acknowledged)."""
        self.block_check: Callable[[bytes, bytes], None] | None = None
        """Called with ``(key, block)`` for every block read from a tier that does not
        verify its reads, after the checksum; a :class:`~kvtier.errors.CorruptBlockError`
        it raises makes the block corrupt (counted, deleted, a miss)."""
        # Tier 0 is written on the caller's thread only if it is fast.
        self._writers: dict[int, BackgroundWriter] = {
            i: BackgroundWriter(t, max_queue=writer_queue, metrics=self.metrics)
            for i, t in enumerate(self.tiers)
            if i > 0 or not t.fast
        }
        for i, tier in enumerate(self.tiers):
            self.metrics.track_usage(tier.name, _used_bytes_of(tier), _capacity_of(tier))
            if self.write_policy is WritePolicy.WRITE_BACK and i + 1 < len(self.tiers):
                tier.set_eviction_listener(functools.partial(self._write_down, i + 1))

    # -- reads -------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], *, deadline: float | None = None) -> int:
        """Number of leading keys present in any tier (prefix semantics).

        ``deadline``: a :func:`time.monotonic` instant for the whole lookup;
        a tier that cannot answer by then counts as a miss.
        """
        n = len(keys)
        if n == 0:
            return 0
        present = [False] * n
        first_hole = 0
        for tier in self.tiers:
            window = keys[first_hole:]
            try:
                with self.metrics.time_op(tier.name, "contains"):
                    found = _contains(tier, window, deadline)
            except KvtierError as e:
                self._tier_failed(tier, "contains", e, len(window))
                continue
            self.metrics.observe_op(tier.name, "contains", "hit", sum(found))
            self.metrics.observe_op(tier.name, "contains", "miss", len(window) - sum(found))
            for j, f in enumerate(found):
                if f:
                    present[first_hole + j] = True
            while first_hole < n and present[first_hole]:
                first_hole += 1
            if first_hole == n:
                break
        hit = first_hole
        outcome = "miss" if hit == 0 else ("hit" if hit == n else "partial")
        self.metrics.lookups.labels(outcome).inc()
        self.metrics.lookup_keys.labels("requested").inc(n)
        self.metrics.lookup_keys.labels("hit").inc(hit)
        return hit

    def contains(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[bool]:
        """Whether each key is present in any tier (``deadline`` as for :meth:`lookup`)."""
        present = [False] * len(keys)
        for tier in self.tiers:
            todo = [i for i, p in enumerate(present) if not p]
            if not todo:
                break
            try:
                found = _contains(tier, [keys[i] for i in todo], deadline)
            except KvtierError as e:
                self._tier_failed(tier, "contains", e, len(todo))
                continue
            for i, f in zip(todo, found, strict=True):
                present[i] = f
        return present

    def get(
        self,
        keys: Sequence[bytes],
        *,
        deadline: float | None = None,
        bound_to: Sequence[bytes] | None = None,
    ) -> list[bytes | None]:
        """Blocks for ``keys`` (``None`` for misses), promoting lower-tier hits.

        ``deadline``: a :func:`time.monotonic` instant for the whole get; each
        tier gets what is left of it, and what a tier could not read in time
        is a miss.

        ``bound_to``: the keys the blocks must carry in their headers, one per
        key, when they differ from the keys they are stored under (the cache
        server stores a tenant's key ``k`` under a scoped key, and its blocks
        carry ``k``); ``keys`` themselves by default.
        """
        bound = keys if bound_to is None else bound_to
        if len(bound) != len(keys):
            raise ValueError(f"bound_to has {len(bound)} keys for {len(keys)} keys")
        result: list[bytes | None] = [None] * len(keys)
        found_in = [-1] * len(keys)
        todo = list(range(len(keys)))
        for ti, tier in enumerate(self.tiers):
            if not todo:
                break
            want = [keys[i] for i in todo]
            try:
                with self.metrics.time_op(tier.name, "get"):
                    blocks = _get(tier, want, deadline)
            except KvtierError as e:
                self._tier_failed(tier, "get", e, len(want))
                continue
            still: list[int] = []
            nbytes = 0
            for i, block in zip(todo, blocks, strict=True):
                if block is not None and not self._valid(tier, keys[i], bound[i], block):
                    block = None
                if block is None:
                    still.append(i)
                else:
                    result[i] = block
                    found_in[i] = ti
                    nbytes += len(block)
            self.metrics.observe_op(tier.name, "get", "hit", len(todo) - len(still))
            self.metrics.observe_op(tier.name, "get", "miss", len(still))
            self.metrics.tier_bytes.labels(tier.name, "get").inc(nbytes)
            todo = still
        self._after_get(keys, result, found_in)
        return result

    def get_prefix(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[bytes]:
        """Blocks of the leading run of keys that are found (stops at the first miss)."""
        out: list[bytes] = []
        for block in self.get(keys, deadline=deadline):
            if block is None:
                break
            out.append(block)
        return out

    def _valid(self, tier: Tier, key: bytes, bound: bytes, block: bytes) -> bool:
        """Whether ``block``, read from ``tier`` under ``key``, is valid and carries ``bound``.

        A tier that verifies its own reads is trusted for the checksum; the
        key is checked for every tier (a header parse and a 16-byte compare).
        """
        try:
            if tier.verifies_reads:
                check_key(read_header(block), bound)
            else:
                verify_block(block, key=bound)
                if self.block_check is not None:
                    self.block_check(key, block)
            return True
        except CorruptBlockError as e:
            log.warning(
                "tier %s returned a corrupt block for %s (%s); deleting it",
                tier.name,
                bound.hex(),
                e,
            )
            self.metrics.count_corrupt(tier.name, e.reason)
            self.metrics.observe_op(tier.name, "get", "corrupt")
            try:
                tier.report_bad([key])
            except KvtierError as de:
                self._tier_failed(tier, "delete", de, 1)
            return False

    def _after_get(
        self, keys: Sequence[bytes], result: list[bytes | None], found_in: list[int]
    ) -> None:
        for i, ti in enumerate(found_in):
            block = result[i]
            if block is None:
                continue
            if ti > 0:
                for up in range(ti):
                    self._write_to(up, keys[i], block)
                    self.metrics.promotions.labels(self.tiers[up].name).inc()
            elif self.write_policy is WritePolicy.SELECTIVE and len(self.tiers) > 1:
                self._count_hit(keys[i], block)

    def _count_hit(self, key: bytes, block: bytes) -> None:
        hits = self._hits.get(key, 0) + 1
        if hits == self.selective_hits:
            for lower in range(1, len(self.tiers)):
                self._write_to(lower, key, block)
        self._hits[key] = hits
        self._hits.move_to_end(key)
        while len(self._hits) > _MAX_TRACKED_HITS:
            self._hits.popitem(last=False)

    # -- writes ------------------------------------------------------------

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Store valid encoded blocks; never blocks on a slow tier.

        The blocks must be valid (encoded in-process, or checked with
        :func:`~kvtier.block.verify_block` by the caller if they came from
        outside): tier 0 trusts them.
        """
        if not items or self._closed:
            return
        targets = (
            range(len(self.tiers)) if self.write_policy is WritePolicy.WRITE_THROUGH else range(1)
        )
        for ti in targets:
            writer = self._writers.get(ti)
            if writer is not None:
                for key, block in items:
                    writer.submit(key, block, wait=self.put_wait_s)
            else:
                tier = self.tiers[ti]
                try:
                    with self.metrics.time_op(tier.name, "put"):
                        stored = tier.put(items)
                except KvtierError as e:
                    self._tier_failed(tier, "put", e, len(items))
                    continue
                ok = sum(stored)
                self.metrics.observe_op(tier.name, "put", "ok", ok)
                self.metrics.observe_op(tier.name, "put", "dropped", len(items) - ok)
                self.metrics.tier_bytes.labels(tier.name, "put").inc(
                    sum(len(b) for (_, b), s in zip(items, stored, strict=True) if s)
                )

    def _write_to(self, ti: int, key: bytes, block: bytes) -> None:
        writer = self._writers.get(ti)
        if writer is not None:
            writer.submit(key, block)
            return
        tier = self.tiers[ti]
        try:
            tier.put([(key, block)])
        except KvtierError as e:
            self._tier_failed(tier, "put", e, 1)

    def _write_down(self, ti: int, key: bytes, block: bytes) -> None:
        """Eviction listener (write-back): hand an evicted block to the next tier."""
        writer = self._writers.get(ti)
        if writer is not None:
            writer.submit(key, block)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove keys from every tier; returns the number removed from the tier that held most."""
        for writer in self._writers.values():
            writer.cancel(keys)
        removed = 0
        for tier in self.tiers:
            try:
                removed = max(removed, tier.delete(keys))
            except KvtierError as e:
                self._tier_failed(tier, "delete", e, len(keys))
        return removed

    def discard_bad(self, keys: Sequence[bytes]) -> int:
        """Remove blocks found wrong from every tier, telling shared tiers why.

        Like :meth:`delete`, but through ``Tier.report_bad``: the cache server
        deletes a reported block even for a reader tenant and counts it
        against the writer that stored it. Returns the most any tier removed.
        """
        for writer in self._writers.values():
            writer.cancel(keys)
        removed = 0
        for tier in self.tiers:
            try:
                removed = max(removed, tier.report_bad(keys))
            except KvtierError as e:
                self._tier_failed(tier, "delete", e, len(keys))
        return removed

    # -- housekeeping --------------------------------------------------------

    def _tier_failed(self, tier: Tier, op: str, e: KvtierError, n: int) -> None:
        kind = _error_kind(e)
        self.metrics.tier_errors.labels(tier.name, kind).inc()
        self.metrics.observe_op(tier.name, op, "skipped" if kind == "unavailable" else "error", n)
        log.debug("tier %s %s failed (%s): %s", tier.name, op, kind, e)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for background writes submitted so far; ``False`` on timeout."""
        return all(w.flush(timeout) for w in self._writers.values())

    def usage(self) -> dict[str, TierUsage]:
        """Per-tier usage; a tier that cannot answer reports zero used and no capacity."""
        out = {}
        for t in self.tiers:
            try:
                out[t.name] = t.usage()
            except KvtierError as e:
                self._tier_failed(t, "usage", e, 0)
                out[t.name] = TierUsage(0, None, None)
        return out

    def check_integrity(self) -> None:
        """Assert every tier's bookkeeping holds (for tests)."""
        for tier in self.tiers:
            tier.check_integrity()

    def close(self, timeout: float = 30.0) -> None:
        """Finish background writes (and write-back flushing), then close every tier."""
        if self._closed:
            return
        self._closed = True
        top = self.tiers[0]
        if (
            (
                self.write_policy is WritePolicy.WRITE_BACK
                and self.flush_on_close
                and len(self.tiers) > 1
            )
            and isinstance(top, CpuTier)
            and 1 in self._writers
        ):
            for key, block in top.drain():
                self._writers[1].submit(key, block, wait=timeout)
        for ti in sorted(self._writers):
            self._writers[ti].close(timeout)
        for tier in self.tiers:
            tier.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# NOTE: without a deadline a tier is called exactly as before deadlines existed, so a
# Tier written against the older contract (no ``deadline`` keyword) keeps working.
def _contains(tier: Tier, keys: Sequence[bytes], deadline: float | None) -> list[bool]:
    return tier.contains(keys) if deadline is None else tier.contains(keys, deadline=deadline)


def _get(tier: Tier, keys: Sequence[bytes], deadline: float | None) -> list[bytes | None]:
    return tier.get(keys) if deadline is None else tier.get(keys, deadline=deadline)
