"""Files of the disk tier that several processes may use at once (no I/O policy, no index).

Layout under a tier's root::

    blocks/<first key byte, hex>/<key hex>.kvb   committed blocks
    tmp/<pid>-<random>.part                      writes in flight

**In-flight files are locked.** A writer creates its temp file, takes an
exclusive ``flock`` on it at once and holds it until the file has been
renamed into ``blocks/`` (or removed). The kernel drops the lock when the
writer's process dies, so "unlocked" means "abandoned": :func:`sweep_tmp`
removes a temp file only if no process holds its lock *and* it is older than
:data:`STALE_TMP_S` (the age covers the instant between creating a file and
locking it, and writers that do not lock). The pid in the name is for people
reading the directory; liveness is the lock's, which also holds across pid
namespaces (containers sharing a host directory) and after pid reuse.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SUFFIX = ".kvb"
TMP_SUFFIX = ".part"

STALE_TMP_S = 300.0
"""An unlocked temp file younger than this is left alone (it may be a write that has not
locked it yet)."""


@dataclass(frozen=True)
class BlockFile:
    """One committed block file as a directory scan saw it."""

    key: bytes
    size: int
    mtime_ns: int


def block_path(blocks_dir: Path, key: bytes) -> Path:
    h = key.hex()
    return blocks_dir / h[:2] / (h + SUFFIX)


def scan_blocks(blocks_dir: Path) -> list[BlockFile]:
    """Every committed block file under ``blocks_dir``, oldest modification first.

    Files that vanish while the scan runs (another process evicted them) are
    skipped; names that are not block names are ignored.
    """
    found: list[BlockFile] = []
    try:
        subdirs = list(os.scandir(blocks_dir))
    except FileNotFoundError:
        return found
    for sub in subdirs:
        try:
            if not sub.is_dir(follow_symlinks=False):
                continue
            entries = list(os.scandir(sub.path))
        except OSError:
            continue
        for entry in entries:
            name = entry.name
            if not name.endswith(SUFFIX):
                continue
            try:
                key = bytes.fromhex(name[: -len(SUFFIX)])
                st = entry.stat(follow_symlinks=False)
            except (ValueError, OSError):
                continue
            found.append(BlockFile(key, st.st_size, st.st_mtime_ns))
    found.sort(key=lambda f: f.mtime_ns)
    return found


def write_block_file(tmp_dir: Path, final: Path, block: bytes, *, fsync: bool) -> int:
    """Write ``block`` to a locked temp file and rename it to ``final``; the file's mtime (ns).

    Raises:
        OSError: the write failed (the temp file is removed).
    """
    tmp = tmp_dir / f"{os.getpid()}-{uuid.uuid4().hex}{TMP_SUFFIX}"
    # parents=True: a directory removed behind our back is recreated.
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir.mkdir(parents=True, exist_ok=True)
    try:
        with open(tmp, "xb") as f:
            # NOTE: the lock marks the file as in flight for other processes' sweeps;
            # it is released when the file is closed, after the rename.
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            f.write(block)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
            mtime_ns = os.fstat(f.fileno()).st_mtime_ns
            os.replace(tmp, final)
        return mtime_ns
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            log.debug("disk tier: could not remove %s", tmp)
        raise


def sweep_tmp(tmp_dir: Path, *, stale_s: float = STALE_TMP_S) -> int:
    """Remove abandoned temp files (unlocked and older than ``stale_s``); how many were removed."""
    removed = 0
    try:
        entries = list(os.scandir(tmp_dir))
    except FileNotFoundError:
        return 0
    now = time.time()
    for entry in entries:
        if not entry.name.endswith(TMP_SUFFIX):
            continue
        try:
            if now - entry.stat(follow_symlinks=False).st_mtime < stale_s:
                continue
            fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue  # gone (renamed into place, or swept by another process)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live writer holds it
            # Still the file we locked? It may have been renamed into place meanwhile.
            if os.fstat(fd).st_ino != os.stat(entry.path, follow_symlinks=False).st_ino:
                continue
            os.unlink(entry.path)
            removed += 1
        except OSError:
            continue
        finally:
            os.close(fd)
    if removed:
        log.info("disk tier: removed %d abandoned temp file(s) from %s", removed, tmp_dir)
    return removed
