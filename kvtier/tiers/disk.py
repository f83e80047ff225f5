"""The disk tier: one file per block under a directory, bounded in bytes, safe for several processes.

Layout and temp-file locking: :mod:`kvtier.tiers.disk_files`. A write goes to
a locked temp file in ``tmp/`` and is renamed into ``blocks/`` (atomic on
POSIX), so a reader never sees half a block under a block name.

**Several processes, one directory.** Any number of processes on a host may
use one root at once (the default directory is host-wide); nothing needs to
be configured for it:

* No process removes another's write in flight: a temp file is removed (at
  start and at each rescan) only when no process holds its lock and it is
  older than :data:`~kvtier.tiers.disk_files.STALE_TMP_S` — what a process
  that died mid-write leaves behind.
* The directory is the truth; each process's index is a cache of it. A key
  this process does not know is looked up on disk (one ``stat``) and
  adopted; a file found gone (another process evicted it) is dropped from
  the index; a put of a key whose file exists is skipped (blocks are
  content-addressed: same key, same bytes) and counted.
* **Capacity is the directory's.** ``capacity_bytes`` bounds the bytes of
  every block file under the root, whoever wrote them (give every process
  the same capacity: the smallest one wins). Each process rescans the
  directory every ``rescan_s`` seconds, and before evicting when its count
  says a put needs room (at most once a second, or every time with
  ``rescan_s`` under a second), so it counts the others' files too and
  evicts least recently used first across processes. Recency crosses
  processes through file mtimes: a hit sets the file's mtime to now (unless
  the policy ignores reads, as FIFO does), a rescan moves files touched by
  others to the recent end, and a victim whose mtime changed since this
  process last looked is spared and refreshed instead. Between rescans the
  directory can exceed the capacity by what the other processes wrote since
  this one last looked; two processes evicting at once can each free room
  for one block, so it then holds up to about one block per concurrent
  writer more.
* Unlinking a file another process is reading is safe on POSIX (the reader
  keeps its open file).

Directories it creates are 0700 and block files 0600 (:mod:`~kvtier.tiers.disk_files`):
only this user reads the KV, which reveals the prompts it came from.

On start the tier removes abandoned temp files and indexes ``blocks/``
(oldest modification first in the eviction order), so its contents survive
restarts. Every read is verified (header, lengths, checksum): a torn,
truncated or corrupt file is a miss, and the file is removed (only if it is
still the file that was read). A full disk, or any other write error, drops
that write (counted) and never raises.

Read deadlines: ``get`` checks the deadline before each file and answers
``None`` for every key it did not get to (the blocks read in time are
returned; the others are misses, their recency untouched). Reading one file
(open, read, checksum) is not interrupted, so a ``get`` returns at most one
file read after the deadline; a deadline already past reads nothing.
``contains`` answers from the in-memory index and looks on disk (one
``stat`` each) for keys it does not know, until the deadline.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.block import verify_block
from kvtier.errors import CorruptBlockError
from kvtier.metrics import StoreMetrics
from kvtier.tiers.base import EvictedKeyListener, EvictionListener, Tier, TierUsage
from kvtier.tiers.disk_files import (
    BlockFile,
    block_path,
    make_private_dirs,
    scan_blocks,
    sweep_tmp,
    write_block_file,
)
from kvtier.tiers.eviction import EvictionPolicy, LRUPolicy

log = logging.getLogger(__name__)

PRESSURE_RESCAN_S = 1.0
"""A put that needs room rescans the directory first if the last scan is older than this."""


@dataclass(slots=True)
class _Entry:
    size: int
    mtime_ns: int  # the file's mtime as this process last saw or set it


class DiskTier(Tier):
    """Blocks as files in a directory tree with a byte capacity (see the module docstring).

    Args:
        root: Directory (created if missing); may be shared by several processes.
        capacity_bytes: Bound on the bytes of all block files in the directory.
        policy: Eviction order; LRU if ``None``.
        fsync: ``fsync`` each block before renaming it into place. Off by
            default: the checksum already turns a block torn by a crash into a
            miss, so durability costs latency without buying correctness.
        rescan_s: How often the directory is rescanned for other processes'
            files (on a put); ``0`` rescans before every put.
        metrics: Counts corrupt blocks, dropped and skipped writes, evictions.
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
        rescan_s: float = 10.0,
        metrics: StoreMetrics | None = None,
        name: str = "disk",
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if rescan_s < 0:
            raise ValueError(f"rescan_s must not be negative, got {rescan_s}")
        self.name = name
        self.root = Path(root).expanduser()
        self.capacity_bytes = capacity_bytes
        self._policy = policy if policy is not None else LRUPolicy()
        self._fsync = fsync
        self._rescan_s = rescan_s
        self._metrics = metrics
        self._lock = threading.Lock()
        self._scan_lock = threading.Lock()  # one rescan at a time; others skip theirs
        self._index: dict[bytes, _Entry] = {}  # committed blocks, this process's view
        self._pending: dict[bytes, int] = {}  # key -> size, our writes in flight (space reserved)
        self._used = 0  # indexed + reserved bytes
        self._last_scan = -float("inf")
        self._foreign = False  # another process changed the directory under us
        self._listener: EvictionListener | None = None
        self._key_listener: EvictedKeyListener | None = None
        self.evictions = 0
        self.dropped_writes = 0
        self.skipped_writes = 0
        self.corrupt_blocks = 0
        self._blocks_dir = self.root / "blocks"
        self._tmp_dir = self.root / "tmp"
        make_private_dirs(self._blocks_dir)
        make_private_dirs(self._tmp_dir)
        if self.root.stat().st_mode & 0o077:
            log.warning(
                "disk tier %s: %s is open to other users (mode %o); KV reveals the prompts "
                "it came from: chmod 700 it unless sharing is meant",
                name,
                self.root,
                self.root.stat().st_mode & 0o777,
            )
        self._rescan()

    # -- the directory ------------------------------------------------------

    def _path(self, key: bytes) -> Path:
        return block_path(self._blocks_dir, key)

    def rescan(self) -> None:
        """Bring the index up to date with the directory now (other processes' writes,
        evictions and reads), then evict down to capacity."""
        self._rescan()

    def _rescan(self) -> None:
        if not self._scan_lock.acquire(blocking=False):
            return  # another thread is scanning; its result serves us too
        try:
            started = time.monotonic()
            sweep_tmp(self._tmp_dir)
            files = scan_blocks(self._blocks_dir)
            with self._lock:
                self._merge(files, confirm=self._last_scan != -float("inf"))
                self._last_scan = started
                while self._used > self.capacity_bytes and self._index:
                    self._evict_one()
        finally:
            self._scan_lock.release()

    def _merge(self, files: list[BlockFile], *, confirm: bool) -> None:
        """Fold a scan into the index. Caller holds the lock.

        The scan ran without the lock, so what it disagrees on is confirmed
        with a ``stat`` (``confirm``; not needed for the first scan): a file
        this process wrote or removed after the scan listed its directory
        must keep its state.
        """
        seen: set[bytes] = set()
        changed: list[BlockFile] = []
        for f in files:  # oldest first
            seen.add(f.key)
            if f.key in self._pending:
                continue
            entry = self._index.get(f.key)
            if entry is None or f.mtime_ns > entry.mtime_ns:
                changed.append(f)
        for key in [k for k in self._index if k not in seen]:
            if not confirm or not self._path(key).exists():
                self._unindex(key)
                self._foreign = True
        for f in changed:
            entry = self._index.get(f.key)
            if entry is None:
                if confirm and not self._path(f.key).exists():
                    continue
                self._index[f.key] = _Entry(f.size, f.mtime_ns)
                self._used += f.size
                self._policy.insert(f.key)
            else:
                self._used += f.size - entry.size
                entry.size, entry.mtime_ns = f.size, f.mtime_ns
                self._policy.access(f.key)
            if confirm:
                self._foreign = True

    def _maybe_rescan(self, need: int) -> None:
        since = time.monotonic() - self._last_scan
        with self._lock:
            tight = self._used + need > self.capacity_bytes
        if since >= self._rescan_s or (tight and since >= min(PRESSURE_RESCAN_S, self._rescan_s)):
            self._rescan()

    def _unindex(self, key: bytes) -> _Entry | None:
        """Drop a key from the index and the accounting. Caller holds the lock."""
        entry = self._index.pop(key, None)
        if entry is not None:
            self._policy.remove(key)
            self._used -= entry.size
        return entry

    # -- Tier --------------------------------------------------------------

    def set_eviction_listener(self, listener: EvictionListener | None) -> None:
        self._listener = listener

    def set_evicted_key_listener(self, listener: EvictedKeyListener | None) -> None:
        self._key_listener = listener

    def contains(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[bool]:
        with self._lock:
            present = [k in self._index for k in keys]
        return [
            p or (not _expired(deadline) and self._adopt(k) is not None)
            for k, p in zip(keys, present, strict=True)
        ]

    def get(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            if _expired(deadline):
                out += [None] * (len(keys) - len(out))  # not read in time: misses
                break
            with self._lock:
                entry = self._index.get(key)
                if entry is not None:
                    self._policy.access(key)
            size = entry.size if entry is not None else self._adopt(key)
            out.append(None if size is None else self._read(key, size))
        return out

    def _adopt(self, key: bytes) -> int | None:
        """Index a block another process wrote; its size, or ``None`` if there is no such file."""
        try:
            st = self._path(key).stat()
        except OSError:
            return None
        with self._lock:
            entry = self._index.get(key)
            if entry is not None:
                return entry.size
            if key in self._pending or st.st_size > self.capacity_bytes:
                return None
            self._index[key] = _Entry(st.st_size, st.st_mtime_ns)
            self._used += st.st_size
            self._policy.insert(key)
            self._foreign = True
            while self._used > self.capacity_bytes:
                self._evict_one()
            entry = self._index.get(key)
            return None if entry is None else entry.size

    def _read(self, key: bytes, size: int) -> bytes | None:
        """The verified block of ``key``, indexed as ``size`` bytes (a file rewritten by
        another process since may differ: the index follows the file)."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
                inode = os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            # Evicted by us between the index check and the open, deleted behind
            # our back, or evicted by another process: a miss, and the index must
            # stop claiming the block.
            with self._lock:
                if self._unindex(key) is not None:
                    self._foreign = True
            return None
        except OSError as e:
            log.warning("disk tier: cannot read %s: %s", path, e)
            return None
        try:
            verify_block(data)
        except CorruptBlockError as e:
            log.warning("disk tier: removing corrupt block %s: %s", path.name, e)
            self._count_corrupt()
            self._remove_if_same(key, path, inode)
            return None
        self._mark_read(key, path, size, len(data))
        return data

    def _mark_read(self, key: bytes, path: Path, indexed: int, size: int) -> None:
        """Record a hit where other processes see it (the file's mtime), and fix the size."""
        now = time.time_ns()
        refresh = self._policy.refreshed_by_reads
        if refresh:
            try:
                os.utime(path, ns=(now, now))
            except OSError:
                refresh = False  # evicted meanwhile; the next read finds it gone
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return
            if refresh:
                entry.mtime_ns = max(entry.mtime_ns, now)
            if indexed != size and entry.size != size:  # rewritten by another process
                self._used += size - entry.size
                entry.size = size

    def _remove_if_same(self, key: bytes, path: Path, inode: int) -> None:
        """Remove a bad block file, unless another process has replaced it since it was read."""
        with self._lock:
            self._unindex(key)
            try:
                if os.stat(path).st_ino == inode:
                    path.unlink()
            except OSError:
                pass  # already gone

    def _count_corrupt(self) -> None:
        self.corrupt_blocks += 1
        if self._metrics is not None:
            self._metrics.corrupt_blocks.labels(self.name).inc()

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        return [self._put_one(key, block) for key, block in items]

    def _put_one(self, key: bytes, block: bytes) -> bool:
        size = len(block)
        with self._lock:
            if key in self._pending:  # being written by another thread: same key, same content
                self._skip(size)
                return True
            indexed = key in self._index
        if indexed:
            # NOTE: the file is looked at (one stat), not just the index: a file deleted
            # behind our back, or evicted by another process, must be written again, or
            # this put would say True for a block that is not there (found by bench/soak.py).
            if self._path(key).exists():
                with self._lock:
                    if key in self._index:
                        self._policy.access(key)
                self._skip(size)
                return True
            with self._lock:
                if key not in self._pending and self._unindex(key) is not None:
                    self._foreign = True
        if self._adopt(key) is not None:
            self._skip(size)  # another process wrote the same content
            return True
        if size > self.capacity_bytes:
            self._drop()
            return False
        self._maybe_rescan(size)
        with self._lock:
            if key in self._index or key in self._pending:
                self._skip(size)  # written by another thread, or found by the rescan
                return True
            while self._used + size > self.capacity_bytes and self._index:
                self._evict_one()
            if self._used + size > self.capacity_bytes:
                # Only in-flight writes hold the space; do not wait for them.
                self._drop()
                return False
            self._pending[key] = size
            self._used += size
        mtime_ns = self._write_file(key, block)
        with self._lock:
            del self._pending[key]
            self._used -= size
            if mtime_ns is None:
                self._drop()
                return False
            entry = self._index.get(key)
            if entry is None:
                self._index[key] = _Entry(size, mtime_ns)
                self._used += size
                self._policy.insert(key)
            else:  # adopted meanwhile (a rescan or a reader saw the new file)
                entry.mtime_ns = max(entry.mtime_ns, mtime_ns)
        return True

    def _skip(self, size: int) -> None:
        self.skipped_writes += 1
        if self._metrics is not None:
            self._metrics.put_skipped(self.name, 1, size)

    def _drop(self) -> None:
        self.dropped_writes += 1
        if self._metrics is not None:
            self._metrics.tier_errors.labels(self.name, "write_dropped").inc()

    def _write_file(self, key: bytes, block: bytes) -> int | None:
        """Write one block file; its mtime (ns), or ``None`` if the write failed."""
        try:
            return write_block_file(self._tmp_dir, self._path(key), block, fsync=self._fsync)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                log.warning("disk tier: disk full, dropping a %d-byte write", len(block))
            else:
                log.warning("disk tier: write failed, dropping it: %s", e)
            return None

    def _evict_one(self) -> None:
        """Remove the policy's victim. Caller holds the lock.

        A victim whose file another process has read (or rewritten) since we
        last looked is refreshed instead, and the next victim is tried; a
        victim whose file is already gone only leaves the index.
        """
        victim = None
        for _ in range(len(self._index)):
            victim = self._policy.victim()
            if victim is None:  # pragma: no cover - bookkeeping bug; check_integrity catches it
                raise AssertionError("disk tier over capacity with nothing to evict")
            entry = self._index[victim]
            try:
                mtime_ns = self._path(victim).stat().st_mtime_ns
            except OSError:
                self._unindex(victim)  # evicted by another process
                self._foreign = True
                return
            if mtime_ns <= entry.mtime_ns:
                break
            entry.mtime_ns = mtime_ns  # used elsewhere since: not the least recent after all
            self._policy.access(victim)
            self._foreign = True
        if victim is None:  # pragma: no cover - only with an empty index
            raise AssertionError("disk tier over capacity with nothing to evict")
        self._unindex(victim)
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
        if self._key_listener is not None:
            self._key_listener(victim)
        path.unlink(missing_ok=True)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove the keys' files, whichever process wrote them; how many were removed."""
        removed = 0
        for key in keys:
            with self._lock:
                self._unindex(key)
                try:
                    self._path(key).unlink()
                    removed += 1
                except FileNotFoundError:
                    pass  # not held (or already removed by another process)
                except OSError as e:
                    log.warning("disk tier: cannot delete %s: %s", self._path(key).name, e)
        return removed

    def usage(self) -> TierUsage:
        """The directory's bytes and blocks as this process last saw them (plus its writes in flight)."""
        with self._lock:
            return TierUsage(self._used, self.capacity_bytes, len(self._index))

    def check_integrity(self) -> None:
        with self._lock:
            committed = sum(e.size for e in self._index.values())
            reserved = sum(self._pending.values())
            assert committed + reserved == self._used, (
                f"disk tier accounts {self._used} B, holds {committed}+{reserved} B"
            )
            assert self._used <= self.capacity_bytes, (
                f"disk tier over capacity: {self._used} > {self.capacity_bytes}"
            )
            assert len(self._policy) == len(self._index), "eviction policy and index disagree"
            if self._foreign:
                return  # another process uses the directory: files may go at any time
            for key, entry in self._index.items():
                path = self._path(key)
                assert path.exists(), f"indexed block {path.name} has no file"
                assert path.stat().st_size == entry.size, (
                    f"block file {path.name} has the wrong size"
                )


def _expired(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline
