"""Shared helpers for the benchmark scripts: timing, memcpy baseline, output.

Every benchmark prints a human-readable table and then, as its last line, one
JSON object with all its figures, so scripts and CI can parse the result.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def timeit(
    fn: Callable[[], object], *, repeat: int = 5, min_time: float = 0.05, warmup: int = 1
) -> float:
    """Median seconds per call of ``fn`` over ``repeat`` samples of at least ``min_time`` each."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        n = 0
        start = time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time:
                break
        samples.append(elapsed / n)
    return statistics.median(samples)


def memcpy_gbps(nbytes: int, *, repeat: int = 5) -> float:
    """Bandwidth of a plain memory copy of ``nbytes`` (numpy ``copyto``), GB/s."""
    src = np.frombuffer(np.random.default_rng(0).bytes(nbytes), dtype=np.uint8)
    dst = np.empty_like(src)
    return nbytes / timeit(lambda: np.copyto(dst, src), repeat=repeat) / 1e9


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table with right-aligned columns."""

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(v) for v in row] for row in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def tune_allocator() -> bool:
    """Apply the allocator setting the ``kvtier`` command line applies to its processes.

    Benchmarks measure what a kvtier process does; every peer measured in the
    same process (Redis' client too) gets the same allocator.
    """
    from kvtier.allocator import retain_freed_memory

    return retain_freed_memory(1 << 30)


def emit(summary: dict[str, Any]) -> None:
    """Print the JSON summary as the last line."""
    print(json.dumps(summary, sort_keys=True))


def load_average() -> tuple[float, float, float]:
    """The host's 1-, 5- and 15-minute load averages."""
    return os.getloadavg()


# Keeps one core busy until its deadline (argv[1] seconds) or until its parent is gone.
_SPIN = """
import os, sys, time
parent, end = os.getppid(), time.monotonic() + float(sys.argv[1])
while time.monotonic() < end and os.getppid() == parent:
    for _ in range(100_000):
        pass
"""


@contextlib.contextmanager
def busy_core(max_seconds: float) -> Iterator[int]:
    """Keeps one core busy with a spinning subprocess for the ``with`` body; yields its PID.

    The spinner ends by itself after ``max_seconds`` or once the benchmark's
    process is gone (bounds should the benchmark die without cleaning up), and
    is killed by PID when the body ends.
    """
    proc = subprocess.Popen([sys.executable, "-c", _SPIN, str(max_seconds)])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait(timeout=30)


def drop_page_cache(root: str | os.PathLike[str]) -> int:
    """Evicts every file under ``root`` from the page cache; returns how many files.

    Each file is flushed first (``fdatasync``: dirty pages cannot be dropped),
    then ``posix_fadvise(DONTNEED)`` drops its cached pages, so the next read
    comes from the device.
    """
    count = 0
    for path in Path(root).rglob("*"):
        if not path.is_file():
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue  # renamed or evicted meanwhile
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        count += 1
    return count
