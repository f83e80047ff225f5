"""Several processes on one disk tier directory (the default directory is host-wide).

Each test runs real worker processes (tests/kvtier/disk_worker.py) against
one directory: nothing they acknowledged is lost while capacity allows,
no process removes another's write in flight, and over capacity the
directory stays near its capacity.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk_files import STALE_TMP_S, SUFFIX
from tests.kvtier.helpers import block, key
from tests.support.timeouts import scaled

REPO = Path(__file__).resolve().parents[2]
BLOCK_LEN = len(block(0))


def start(mode: str, root: Path, out: Path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.kvtier.disk_worker", mode, str(root), str(out), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def finish(proc: subprocess.Popen[bytes], out: Path) -> dict[str, object]:
    try:
        output, _ = proc.communicate(timeout=scaled(60))
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"worker did not finish: {output.decode(errors='replace')[-2000:]}")
    assert proc.returncode == 0, output.decode(errors="replace")[-2000:]
    report: dict[str, object] = json.loads(out.read_text())
    return report


def wait_for(path: Path) -> None:
    end = time.monotonic() + scaled(30)
    while not path.exists():
        assert time.monotonic() < end, f"no {path.name} from the worker"
        time.sleep(0.005)


def release(tmp_path: Path, workers: list[subprocess.Popen[bytes]]) -> None:
    """Start the churn workers together, once every one has opened the tier."""
    try:
        for w in range(1, len(workers) + 1):
            wait_for(tmp_path / f"ready-{w}")
    except BaseException:
        for p in workers:
            p.kill()
            p.wait()
        raise
    (tmp_path / "go").touch()


def block_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "blocks").rglob("*" + SUFFIX))


def age(path: Path) -> None:
    """Make a file look abandoned long ago (older than the sweep's grace period)."""
    old = time.time() - STALE_TMP_S - 60
    os.utime(path, (old, old))


def test_a_write_in_flight_survives_another_process_starting(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    holder = start("hold", root, tmp_path / "a.json", "--worker", "7")
    try:
        wait_for(tmp_path / "held")
        tmp_file = Path((tmp_path / "held").read_text())
        assert tmp_file.exists() and tmp_file.name.startswith(f"{holder.pid}-")
        age(tmp_file)  # old enough to be swept if it were abandoned: only its lock protects it
        other = DiskTier(root, BLOCK_LEN * 100)  # this process starts on the directory: a sweep
        other.rescan()  # and sweeps again
        assert tmp_file.exists()
    finally:
        (tmp_path / "go").touch()
    report = finish(holder, tmp_path / "a.json")
    assert report == {"ok": True, "dropped": 0}
    assert other.get([key(7)]) == [block(7)]  # adopted from the directory


def test_a_crashed_writers_temp_file_is_removed_once_old(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    holder = start("hold", root, tmp_path / "a.json", "--worker", "3")
    try:
        wait_for(tmp_path / "held")
        tmp_file = Path((tmp_path / "held").read_text())
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=scaled(30))
    DiskTier(root, BLOCK_LEN * 100)
    assert tmp_file.exists()  # unlocked now, but young: it could be a write about to lock it
    age(tmp_file)
    tier = DiskTier(root, BLOCK_LEN * 100)
    assert not tmp_file.exists()
    assert tier.get([key(3)]) == [None]


def test_two_processes_lose_nothing_they_acknowledged(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    common = ["--rounds", "40", "--per-round", "3", "--shared", "12", "--rescan-s", "0"]
    workers = [
        start("churn", root, tmp_path / f"w{w}.json", "--worker", str(w), "--reopen", "7", *common)
        for w in (1, 2)
    ]
    release(tmp_path, workers)
    reports = [finish(p, tmp_path / f"w{w}.json") for w, p in zip((1, 2), workers, strict=True)]
    for r in reports:
        assert r["refused"] == 0 and r["dropped"] == 0
        assert r["wrong"] == 0 and r["corrupt"] == 0
    acked = {i for r in reports for i in r["acked"]}  # type: ignore[attr-defined]
    assert len(acked) >= 2 * 40 * 3  # every fresh key of both, plus shared ones
    # Both wrote the shared keys; all but the first writer of each skipped the write.
    assert sum(r["skipped"] for r in reports) > 0  # type: ignore[misc]
    reader = DiskTier(root, 1 << 30)
    got = reader.get([key(i) for i in sorted(acked)])
    lost = [i for i, g in zip(sorted(acked), got, strict=True) if g != block(i)]
    assert lost == []
    assert reader.usage().num_blocks == len(acked)
    assert list((root / "tmp").iterdir()) == []
    reader.check_integrity()


def test_two_processes_over_capacity_keep_the_directory_near_it(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    capacity = BLOCK_LEN * 24
    common = ["--rounds", "30", "--per-round", "2", "--shared", "4", "--rescan-s", "0"]
    workers = [
        start("churn", root, tmp_path / f"w{w}.json", "--worker", str(w), "--capacity",
              str(capacity), *common)
        for w in (1, 2)
    ]  # fmt: skip
    release(tmp_path, workers)
    reports = [finish(p, tmp_path / f"w{w}.json") for w, p in zip((1, 2), workers, strict=True)]
    assert all(r["wrong"] == 0 and r["corrupt"] == 0 for r in reports)
    # Together they wrote ~128 blocks into room for 24. Each evicts what it needs, counting
    # the other's files; two evicting at once can each make room: one block over per writer.
    total = block_bytes(root)
    assert capacity - 2 * BLOCK_LEN <= total <= capacity + 2 * BLOCK_LEN
    reader = DiskTier(root, capacity)
    assert reader.usage().used_bytes == total
    reader.check_integrity()
