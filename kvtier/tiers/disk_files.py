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

**Private by default.** KV reveals the prompts it was computed from, so
directories the tier creates are ``0700`` (:data:`DIR_MODE`) and block files
``0600`` (:data:`FILE_MODE`), whatever the umask: only the user the engines
run as can read or write them. A directory that already exists keeps its
mode (an operator may share one on purpose); :func:`is_shared_dir` tells
whether others can write it.
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


DIR_MODE = 0o700
FILE_MODE = 0o600


def make_private_dirs(path: Path) -> None:
    """Create ``path`` and its missing parents with mode 0700 (existing ones are left as they are)."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=DIR_MODE)
        except FileExistsError:
            continue  # another process made it meanwhile
        os.chmod(d, DIR_MODE)  # NOTE: mkdir's mode is masked by the umask; chmod is not


def is_shared_dir(path: Path) -> bool:
    """Whether principals other than this user can write ``path`` (group/other write, another owner)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return bool(st.st_mode & 0o022) or st.st_uid != os.geteuid()


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
    # a directory removed behind our back is recreated (private)
    if not final.parent.is_dir():
        make_private_dirs(final.parent)
    if not tmp_dir.is_dir():
        make_private_dirs(tmp_dir)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        with open(fd, "wb") as f:
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
