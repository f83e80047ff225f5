"""Shared helpers for the benchmark scripts: timing, memcpy baseline, output.

Every benchmark prints a human-readable table and then, as its last line, one
JSON object with all its figures, so scripts and CI can parse the result.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
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
    import os

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
