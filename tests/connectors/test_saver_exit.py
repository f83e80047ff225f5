"""A process that exits with saves still queued stores them and exits cleanly.

The saver's thread holds torch tensors; left running while the interpreter
finalizes, it used to abort the process ("terminate called without an active
exception") and lose what was queued.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import torch
    from kvtier.connectors.saver import ChunkSaver
    from kvtier.block import Compression, Encoding
    from kvtier.metrics import StoreMetrics
    from kvtier.store import TieredStore
    from kvtier.tiers.disk import DiskTier

    class SlowDisk(DiskTier):
        def put(self, items):
            time.sleep(0.05)  # still busy when the main thread returns
            return super().put(items)

    store = TieredStore([SlowDisk(sys.argv[1], 1 << 30)], metrics=StoreMetrics())
    saver = ChunkSaver(store, encoding=Encoding.RAW, compression=Compression.NONE,
                       max_queue=64, metrics=StoreMetrics())
    for i in range(20):
        chunk = torch.randn(2, 2, 16, 2, 8, dtype=torch.bfloat16)
        assert saver.submit(i.to_bytes(16, "big"), chunk, torch.bfloat16)
    # no close(): the interpreter exits with saves queued
    """
)


def test_queued_saves_are_stored_at_exit(tmp_path: Path) -> None:
    blocks = tmp_path / "blocks"
    for _ in range(3):  # the abort was a race: a few runs
        out = subprocess.run(
            [sys.executable, "-c", _SCRIPT, str(blocks)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=Path(__file__).resolve().parents[2],
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert "terminate called" not in out.stderr
    stored = [p for p in blocks.rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert len(stored) >= 20, sorted(p.name for p in stored)
