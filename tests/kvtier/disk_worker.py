"""A process that uses a disk tier directory, for tests/kvtier/test_disk_processes.py.

``python -m tests.kvtier.disk_worker MODE ROOT OUT [options]``; it writes a
JSON report to OUT when done. Modes:

* ``churn``: opens the tier, writes ``ROOT/../ready-<worker>``, waits for
  ``ROOT/../go``, then for ``--rounds`` rounds puts a
  batch (``--shared`` keys every worker writes, same bytes, and fresh keys
  of its own), reads back earlier keys and checks their bytes, and closes
  and reopens the tier every ``--reopen`` rounds (a restart: sweep + scan).
  Reports the keys whose put returned ``True`` (acknowledged).
* ``hold``: puts one block but stops between writing its temp file and
  renaming it into place (it writes ``ROOT/../held`` with the temp file's
  path) until ``ROOT/../go`` appears; reports whether the put succeeded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

from kvtier.tiers import disk_files
from kvtier.tiers.disk import DiskTier
from tests.kvtier.helpers import block, key

WAIT_S = 120.0  # bound on every wait for the test's signals


def _wait_for(path: Path) -> None:
    end = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > end:
            sys.exit(f"gave up waiting for {path}")
        time.sleep(0.005)


def churn(root: Path, args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(args.worker)
    tier = DiskTier(root, args.capacity, rescan_s=args.rescan_s)
    (root.parent / f"ready-{args.worker}").touch()
    _wait_for(root.parent / "go")
    acked: list[int] = []
    refused = wrong = 0
    dropped = skipped = corrupt = 0
    own = 0
    for r in range(args.rounds):
        ids = [rng.randrange(args.shared) for _ in range(2)]
        ids += [args.worker * 100_000 + own + j for j in range(args.per_round)]
        own += args.per_round
        results = tier.put([(key(i), block(i)) for i in ids])
        for i, ok in zip(ids, results, strict=True):
            if ok:
                acked.append(i)
            else:
                refused += 1
        if acked:
            sample = rng.sample(acked, min(3, len(acked)))
            for i, got in zip(sample, tier.get([key(i) for i in sample]), strict=True):
                if got is not None and got != block(i):
                    wrong += 1
        if args.reopen and (r + 1) % args.reopen == 0:
            dropped += tier.dropped_writes
            skipped += tier.skipped_writes
            corrupt += tier.corrupt_blocks
            tier.close()
            tier = DiskTier(root, args.capacity, rescan_s=args.rescan_s)
    tier.check_integrity()
    return {
        "acked": acked,
        "refused": refused,
        "wrong": wrong,
        "dropped": dropped + tier.dropped_writes,
        "skipped": skipped + tier.skipped_writes,
        "corrupt": corrupt + tier.corrupt_blocks,
        "used": tier.usage().used_bytes,
    }


def hold(root: Path, args: argparse.Namespace) -> dict[str, object]:
    tier = DiskTier(root, args.capacity)
    real_replace = os.replace

    def replace_later(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        (root.parent / "held").write_text(os.fspath(src))
        _wait_for(root.parent / "go")
        real_replace(src, dst)

    disk_files.os.replace = replace_later  # type: ignore[assignment]
    try:
        (ok,) = tier.put([(key(args.worker), block(args.worker))])
    finally:
        disk_files.os.replace = real_replace  # type: ignore[assignment]
    return {"ok": ok, "dropped": tier.dropped_writes}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["churn", "hold"])
    p.add_argument("root", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--worker", type=int, default=0)
    p.add_argument("--capacity", type=int, default=1 << 30)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--per-round", type=int, default=3)
    p.add_argument("--shared", type=int, default=10)
    p.add_argument("--reopen", type=int, default=0)
    p.add_argument("--rescan-s", type=float, default=10.0)
    args = p.parse_args()
    report = churn(args.root, args) if args.mode == "churn" else hold(args.root, args)
    args.out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
