"""The disk tier: one file per block under a directory, bounded in bytes.

Layout under ``root``::

    blocks/<first key byte, hex>/<key hex>.kvb   committed blocks
    tmp/<random>.part                            writes in flight

A write goes to ``tmp/`` and is renamed into place (atomic on POSIX), so a
reader never sees half a block under a block name. With ``shared=True``
several processes on one host may use the same directory: a key missing from
this process's index is looked up on disk and adopted, and a file another
process evicted is dropped from the index when it is found gone (capacity is
then enforced per process, so the directory may briefly hold a little more). On start the tier removes
leftover temp files and re-indexes ``blocks/`` (oldest modification first in
the eviction order), so its contents survive restarts. Every read is
verified (header, lengths, checksum): a torn, truncated or corrupt file is a
miss, and the file is removed. A full disk, or any other write error, drops
that write (counted) and never raises.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path

from kvtier.block import verify_block
from kvtier.errors import CorruptBlockError
from kvtier.metrics import StoreMetrics
from kvtier.tiers.base import EvictionListener, Tier, TierUsage
from kvtier.tiers.eviction import EvictionPolicy, LRUPolicy

log = logging.getLogger(__name__)

_SUFFIX = ".kvb"


class DiskTier(Tier):
    """Blocks as files in a directory tree with a byte capacity.

    Args:
        root: Directory (created if missing). Processes that use one root at
            the same time must all pass ``shared=True``.
        capacity_bytes: Sum of block file sizes never exceeds this.
        policy: Eviction order; LRU if ``None``.
        fsync: ``fsync`` each block before renaming it into place. Off by
            default: the checksum already turns a block torn by a crash into a
            miss, so durability costs latency without buying correctness.
        shared: Other processes use this directory too (see the module docstring).
        metrics: Counts corrupt blocks and dropped writes.
        name: Metrics label.
    """

    verifies_reads = True

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        policy: EvictionPolicy | None = None,
        *,
        fsync: bool = False,
        shared: bool = False,
        metrics: StoreMetrics | None = None,
        name: str = "disk",
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.name = name
        self.root = Path(root).expanduser()
        self.capacity_bytes = capacity_bytes
        self._policy = policy if policy is not None else LRUPolicy()
        self._fsync = fsync
        self.shared = shared
        self._metrics = metrics
        self._lock = threading.Lock()
        self._index: dict[bytes, int] = {}  # key -> file size, committed blocks
        self._pending: dict[bytes, int] = {}  # key -> size, writes in flight (space reserved)
        self._used = 0  # committed + reserved bytes
        self._listener: EvictionListener | None = None
        self.evictions = 0
        self.dropped_writes = 0
        self.corrupt_blocks = 0
        self._blocks_dir = self.root / "blocks"
        self._tmp_dir = self.root / "tmp"
        self._blocks_dir.mkdir(parents=True, exist_ok=True)
        self._tmp_dir.mkdir(parents=True, exist_ok=True)
        self._reindex()

    # -- paths -------------------------------------------------------------

    def _path(self, key: bytes) -> Path:
        h = key.hex()
        return self._blocks_dir / h[:2] / (h + _SUFFIX)

    def _reindex(self) -> None:
        if not self.shared:
            # NOTE: in a shared directory another process may be mid-write.
            for leftover in self._tmp_dir.iterdir():
                leftover.unlink(missing_ok=True)
        found: list[tuple[float, bytes, int]] = []
        for sub in self._blocks_dir.iterdir():
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                name = f.name
                if not name.endswith(_SUFFIX):
                    continue
                try:
                    key = bytes.fromhex(name[: -len(_SUFFIX)])
                    st = f.stat()
                except (ValueError, OSError):
                    continue
                found.append((st.st_mtime, key, st.st_size))
        found.sort()
        for _, key, size in found:
            self._index[key] = size
            self._used += size
            self._policy.insert(key)
        while self._used > self.capacity_bytes:
            self._evict_one()

    # -- Tier --------------------------------------------------------------

    def set_eviction_listener(self, listener: EvictionListener | None) -> None:
        self._listener = listener

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            present = [k in self._index for k in keys]
        if self.shared:
            present = [p or self._adopt(k) is not None for k, p in zip(keys, present, strict=True)]
        return present

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            with self._lock:
                size = self._index.get(key)
                if size is not None:
                    self._policy.access(key)
            if size is None and self.shared:
                size = self._adopt(key)
            out.append(None if size is None else self._read(key, size))
        return out

    def _adopt(self, key: bytes) -> int | None:
        """Index a block another process wrote into the shared directory; its size or ``None``."""
        try:
            size = self._path(key).stat().st_size
        except OSError:
            return None
        with self._lock:
            if key in self._index:
                return self._index[key]
            if key in self._pending or size > self.capacity_bytes:
                return None
            self._index[key] = size
            self._used += size
            self._policy.insert(key)
            while self._used > self.capacity_bytes:
                self._evict_one()
            return self._index.get(key)

    def _forget(self, key: bytes, size: int) -> None:
        """The block's file is gone (deleted behind our back, or by another process): unindex it."""
        with self._lock:
            if self._index.get(key) == size:
                del self._index[key]
                self._policy.remove(key)
                self._used -= size

    def _read(self, key: bytes, size: int) -> bytes | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            # Evicted by us between the index check and the open, deleted behind
            # our back, or evicted by another process sharing the directory: a
            # miss, and the index must stop claiming the block.
            self._forget(key, size)
            return None
        except OSError as e:
            log.warning("disk tier: cannot read %s: %s", path, e)
            return None
        try:
            if len(data) != size:
                raise CorruptBlockError(f"file is {len(data)} bytes, indexed as {size}")
            verify_block(data)
        except CorruptBlockError as e:
            log.warning("disk tier: removing corrupt block %s: %s", path.name, e)
            self._count_corrupt()
            self.delete([key])
            return None
        return data

    def _count_corrupt(self) -> None:
        self.corrupt_blocks += 1
        if self._metrics is not None:
            self._metrics.corrupt_blocks.labels(self.name).inc()

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        return [self._put_one(key, block) for key, block in items]

    def _put_one(self, key: bytes, block: bytes) -> bool:
        size = len(block)
        with self._lock:
            if key in self._index:
                self._policy.access(key)
                return True
            if key in self._pending:
                return True  # another thread is writing the same content
        if self.shared and self._adopt(key) is not None:
            return True  # another process wrote the same content
        with self._lock:
            if key in self._index or key in self._pending:
                return True  # written by another thread meanwhile
            if size > self.capacity_bytes:
                self._drop()
                return False
            while self._used + size > self.capacity_bytes and self._index:
                self._evict_one()
            if self._used + size > self.capacity_bytes:
                # Only in-flight writes hold the space; do not wait for them.
                self._drop()
                return False
            self._pending[key] = size
            self._used += size
        ok = self._write_file(key, block)
        with self._lock:
            del self._pending[key]
            if ok:
                self._index[key] = size
                self._policy.insert(key)
            else:
                self._used -= size
                self._drop()
        return ok

    def _drop(self) -> None:
        self.dropped_writes += 1
        if self._metrics is not None:
            self._metrics.tier_errors.labels(self.name, "write_dropped").inc()

    def _write_file(self, key: bytes, block: bytes) -> bool:
        tmp = self._tmp_dir / f"{uuid.uuid4().hex}.part"
        final = self._path(key)
        try:
            # parents=True: a directory removed behind our back is recreated.
            final.parent.mkdir(parents=True, exist_ok=True)
            self._tmp_dir.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(block)
                if self._fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
            return True
        except OSError as e:
            if e.errno == errno.ENOSPC:
                log.warning("disk tier: disk full, dropping a %d-byte write", len(block))
            else:
                log.warning("disk tier: write failed, dropping it: %s", e)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                log.debug("disk tier: could not remove %s", tmp)
            return False

    def _evict_one(self) -> None:
        """Remove the policy's victim. Caller holds the lock."""
        victim = self._policy.victim()
        if victim is None:  # pragma: no cover - bookkeeping bug; check_integrity catches it
            raise AssertionError("disk tier over capacity with nothing to evict")
        size = self._index.pop(victim)
        self._policy.remove(victim)
        self._used -= size
        self.evictions += 1
        if self._metrics is not None:
            self._metrics.evictions.labels(self.name).inc()
        path = self._path(victim)
        if self._listener is not None:
            try:
                data = path.read_bytes()
            except OSError:
                data = b""
            if data:
                self._listener(victim, data)
        path.unlink(missing_ok=True)

    def delete(self, keys: Sequence[bytes]) -> int:
        removed = 0
        for key in keys:
            with self._lock:
                size = self._index.pop(key, None)
                if size is None:
                    continue
                self._policy.remove(key)
                self._used -= size
                self._path(key).unlink(missing_ok=True)
            removed += 1
        return removed

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(self._used, self.capacity_bytes, len(self._index))

    def check_integrity(self) -> None:
        with self._lock:
            committed = sum(self._index.values())
            reserved = sum(self._pending.values())
            assert committed + reserved == self._used, (
                f"disk tier accounts {self._used} B, holds {committed}+{reserved} B"
            )
            assert self._used <= self.capacity_bytes, (
                f"disk tier over capacity: {self._used} > {self.capacity_bytes}"
            )
            assert len(self._policy) == len(self._index), "eviction policy and index disagree"
            if self.shared:
                return  # other processes may remove files at any time
            for key, size in self._index.items():
                path = self._path(key)
                assert path.exists(), f"indexed block {path.name} has no file"
                assert path.stat().st_size == size, f"block file {path.name} has the wrong size"
