"""Allocator tuning of kvtier processes (glibc only).

Every block a server receives or sends passes through fresh multi-megabyte
buffers (gRPC's message bytes, the reassembled block). glibc's malloc serves
large requests with ``mmap`` and returns freed heap memory to the kernel
eagerly, so each new buffer page-faults and is zeroed again: on the
benchmark VM page faults were a fifth of the receiving process's CPU time
(``docs/server.md``). Raising the trim and mmap thresholds keeps freed memory
in the process for reuse. The cost is resident memory that stays at its
high-water mark (bounded by the threshold), which a cache server holding
gigabytes of blocks does not notice.

Called once from process entry points — the ``kvtier`` command line applies
it to every command (``KVTIER_MALLOC_RETAIN``, default 1 GiB, ``0`` to turn it
off; ``kvtier serve`` then applies its own ``server.malloc_retain``) — never
from library code: it changes the whole process's allocator. An engine
embedded in another program can call :func:`retain_freed_memory` itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_CAP = 512 * 1024 * 1024


def retain_freed_memory(limit: int) -> bool:
    """Keep up to ``limit`` freed bytes for reuse and serve large blocks from the heap.

    Returns:
        Whether the allocator was tuned (``False`` when not on glibc).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
    except OSError as e:
        log.info("allocator not tuned: cannot load %s (%s)", name, e)
        return False
    ok = libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(min(limit, 2**31 - 1))) == 1
    ok = libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(min(limit, _MMAP_THRESHOLD_CAP))) == 1 and ok
    log.info("allocator: retain freed memory up to %d bytes: %s", limit, "on" if ok else "refused")
    return ok
