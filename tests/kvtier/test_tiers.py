from __future__ import annotations

import errno
import os
import random
import threading
import time
from pathlib import Path

import pytest

from kvtier.tiers.base import Tier
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk_files import STALE_TMP_S
from kvtier.tiers.eviction import FIFOPolicy, LFUPolicy, LRUPolicy, make_policy
from tests.kvtier.helpers import block, key

BLOCK_LEN = len(block(0))


@pytest.fixture(params=["cpu", "disk"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
    cap = BLOCK_LEN * 5
    if request.param == "cpu":
        t: Tier = CpuTier(cap)
    else:
        t = DiskTier(tmp_path / "d", cap)
    yield t
    t.close()


def test_put_get_contains_delete(tier: Tier) -> None:
    items = [(key(i), block(i)) for i in range(3)]
    assert tier.put(items) == [True] * 3
    assert tier.contains([key(0), key(9), key(2)]) == [True, False, True]
    assert tier.get([key(1), key(9)]) == [block(1), None]
    assert tier.prefix_length([key(0), key(1), key(9), key(2)]) == 2
    assert tier.delete([key(1), key(9)]) == 1
    assert tier.get([key(1)]) == [None]
    assert tier.usage().num_blocks == 2 and tier.usage().used_bytes == 2 * BLOCK_LEN
    tier.check_integrity()


def test_lru_eviction_and_listener(tier: Tier) -> None:
    evicted: list[bytes] = []
    tier.set_eviction_listener(lambda k, b: evicted.append(k))
    tier.put([(key(i), block(i)) for i in range(5)])
    tier.get([key(0)])  # refresh 0: 1 becomes the oldest
    tier.put([(key(5), block(5))])
    assert evicted == [key(1)]
    assert tier.contains([key(0), key(1), key(5)]) == [True, False, True]
    tier.check_integrity()


def test_block_larger_than_capacity_is_refused(tier: Tier) -> None:
    big = block(1, tokens=64)
    assert len(big) > BLOCK_LEN * 5
    assert tier.put([(key(1), big)]) == [False]
    assert tier.usage().used_bytes == 0
    tier.check_integrity()


def test_rewrite_of_present_key_is_harmless(tier: Tier) -> None:
    tier.put([(key(1), block(1))])
    assert tier.put([(key(1), block(1))]) == [True]
    assert tier.usage().num_blocks == 1
    tier.check_integrity()


def test_never_over_capacity_under_concurrency(tier: Tier) -> None:
    cap = tier.usage().capacity_bytes
    assert cap is not None
    errors: list[BaseException] = []
    stop = time.monotonic() + 3.0
    over: list[int] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                if time.monotonic() > stop:
                    return
                i = rng.randrange(40)
                op = rng.random()
                if op < 0.5:
                    tier.put([(key(i), block(i))])
                elif op < 0.9:
                    got = tier.get([key(i)])[0]
                    assert got is None or got == block(i)
                else:
                    tier.delete([key(i)])
                used = tier.usage().used_bytes
                if used > cap:
                    over.append(used)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert not over
    tier.check_integrity()


def test_policies_order() -> None:
    for policy, expected in ((LRUPolicy(), b"b"), (FIFOPolicy(), b"a"), (LFUPolicy(), b"b")):
        for k in (b"a", b"b", b"c"):
            policy.insert(k)
        policy.access(b"a")
        policy.access(b"c")
        assert policy.victim() == expected, type(policy)
        policy.remove(expected)
        assert len(policy) == 2
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("random")


def test_disk_survives_restart(tmp_path: Path) -> None:
    d = DiskTier(tmp_path, BLOCK_LEN * 10)
    d.put([(key(i), block(i)) for i in range(4)])
    d.close()
    d2 = DiskTier(tmp_path, BLOCK_LEN * 10)
    assert d2.get([key(i) for i in range(4)]) == [block(i) for i in range(4)]
    assert d2.usage().used_bytes == 4 * BLOCK_LEN
    d2.check_integrity()


def test_disk_restart_with_smaller_capacity_evicts(tmp_path: Path) -> None:
    d = DiskTier(tmp_path, BLOCK_LEN * 10)
    d.put([(key(i), block(i)) for i in range(6)])
    d2 = DiskTier(tmp_path, BLOCK_LEN * 3)
    assert d2.usage().num_blocks == 3
    d2.check_integrity()


def test_disk_corrupt_or_truncated_file_is_a_miss_and_removed(tmp_path: Path) -> None:
    d = DiskTier(tmp_path, BLOCK_LEN * 10)
    d.put([(key(i), block(i)) for i in range(3)])
    files = {p.name: p for p in (tmp_path / "blocks").rglob("*.kvb")}
    f0 = files[key(0).hex() + ".kvb"]
    data = bytearray(f0.read_bytes())
    data[-1] ^= 0xFF
    f0.write_bytes(bytes(data))
    f1 = files[key(1).hex() + ".kvb"]
    f1.write_bytes(f1.read_bytes()[:100])
    assert d.get([key(0), key(1), key(2)]) == [None, None, block(2)]
    assert not f0.exists() and not f1.exists()
    assert d.corrupt_blocks == 2
    d.check_integrity()
    # A half-written file found at start (same size as indexed, bad content) is caught on read too.
    d.close()
    (tmp_path / "tmp" / "x.part").write_bytes(b"half")
    stale = time.time() - STALE_TMP_S - 1  # abandoned (unlocked and old), not a write in flight
    os.utime(tmp_path / "tmp" / "x.part", (stale, stale))
    d2 = DiskTier(tmp_path, BLOCK_LEN * 10)
    assert not (tmp_path / "tmp" / "x.part").exists()
    assert d2.get([key(2)]) == [block(2)]


def test_disk_full_drops_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = DiskTier(tmp_path, BLOCK_LEN * 10)
    d.put([(key(0), block(0))])
    real_replace = __import__("os").replace

    def full(src: str, dst: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("kvtier.tiers.disk.os.replace", full)
    assert d.put([(key(1), block(1)), (key(2), block(2))]) == [False, False]
    assert d.dropped_writes == 2
    assert list((tmp_path / "tmp").iterdir()) == []
    d.check_integrity()
    monkeypatch.setattr("kvtier.tiers.disk.os.replace", real_replace)
    assert d.put([(key(1), block(1))]) == [True]
    assert d.get([key(0), key(1)]) == [block(0), block(1)]
    d.check_integrity()


def test_disk_forgets_files_deleted_behind_its_back(tmp_path: Path) -> None:
    d = DiskTier(tmp_path, BLOCK_LEN * 10)
    d.put([(key(i), block(i)) for i in range(2)])
    (tmp_path / "blocks" / key(0).hex()[:2] / (key(0).hex() + ".kvb")).unlink()
    assert d.get([key(0), key(1)]) == [None, block(1)]
    assert d.contains([key(0)]) == [False]  # the index no longer claims it
    assert d.usage().num_blocks == 1
    d.check_integrity()


def test_disk_put_after_a_file_vanished_writes_it_again(tmp_path: Path) -> None:
    # Found by bench/soak.py: a put of a key still indexed was skipped although its file was
    # gone (deleted, or evicted by another process sharing the directory); the put said True.
    d = DiskTier(tmp_path, BLOCK_LEN * 10)
    d.put([(key(0), block(0))])
    (tmp_path / "blocks" / key(0).hex()[:2] / (key(0).hex() + ".kvb")).unlink()
    assert d.put([(key(0), block(0))]) == [True]
    assert d.get([key(0)]) == [block(0)]
    assert d.skipped_writes == 0
    d.check_integrity()


def test_two_processes_share_one_directory(tmp_path: Path) -> None:
    a = DiskTier(tmp_path, BLOCK_LEN * 4)
    b = DiskTier(tmp_path, BLOCK_LEN * 4)  # indexed before a writes anything
    a.put([(key(i), block(i)) for i in range(3)])
    assert b.contains([key(0), key(1), key(9)]) == [True, True, False]  # adopted from disk
    assert b.get([key(2)]) == [block(2)]
    assert b.put([(key(1), block(1))]) == [True]  # already there: adopted, not rewritten
    # b fills its own capacity and evicts files a still has indexed: a sees misses, not errors.
    b.put([(key(i), block(i)) for i in range(10, 14)])
    got = a.get([key(i) for i in range(3)])
    assert all(g is None or g == block(i) for i, g in enumerate(got))
    assert None in got
    a.check_integrity()
    b.check_integrity()
    assert b.usage().used_bytes <= BLOCK_LEN * 4


def test_cpu_tier_ignores_read_deadlines() -> None:
    cpu = CpuTier(BLOCK_LEN * 4)
    cpu.put([(key(0), block(0))])
    past = time.monotonic() - 1
    assert cpu.get([key(0), key(1)], deadline=past) == [block(0), None]
    assert cpu.contains([key(0), key(1)], deadline=past) == [True, False]
    assert cpu.prefix_length([key(0), key(1)], deadline=past) == 1


def test_disk_deadline_in_the_past_reads_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = DiskTier(tmp_path / "d", BLOCK_LEN * 10, policy=LRUPolicy())
    disk.put([(key(i), block(i)) for i in range(3)])
    reads: list[bytes] = []
    real_read = disk._read

    def counted_read(k: bytes, size: int) -> bytes | None:
        reads.append(k)
        return real_read(k, size)

    monkeypatch.setattr(disk, "_read", counted_read)
    assert disk.get([key(0), key(1), key(2)], deadline=time.monotonic()) == [None] * 3
    assert disk.get([key(0)], deadline=time.monotonic() - 1) == [None]
    assert reads == []
    # recency untouched: key 0 is still the LRU victim (a read would have made it key 1)
    disk.put([(key(i), block(i)) for i in range(3, 10)])
    disk.put([(key(10), block(10))])
    assert disk.contains([key(0), key(1)]) == [False, True]
    # the index answers contains without I/O, deadline or not
    assert disk.contains([key(1), key(99)], deadline=time.monotonic() - 1) == [True, False]
    assert disk.get([key(1)], deadline=None) == [block(1)]


def test_disk_deadline_mid_batch_returns_what_was_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = DiskTier(tmp_path / "d", BLOCK_LEN * 10)
    disk.put([(key(i), block(i)) for i in range(4)])
    deadline = time.monotonic() + 1.0
    reads: list[bytes] = []
    real_read = disk._read

    def slow_read(k: bytes, size: int) -> bytes | None:
        reads.append(k)
        data = real_read(k, size)
        time.sleep(max(0.0, deadline - time.monotonic()) + 0.01)  # this read ends past the deadline
        return data

    monkeypatch.setattr(disk, "_read", slow_read)
    got = disk.get([key(0), key(1), key(2), key(3)], deadline=deadline)
    assert got == [block(0), None, None, None]  # one file read after the deadline at most
    assert reads == [key(0)]


def test_shared_disk_contains_stops_looking_at_the_deadline(tmp_path: Path) -> None:
    a = DiskTier(tmp_path / "d", BLOCK_LEN * 10)
    b = DiskTier(tmp_path / "d", BLOCK_LEN * 10)
    a.put([(key(0), block(0))])
    assert b.contains([key(0)], deadline=time.monotonic() - 1) == [False]  # no stat after it
    assert b.contains([key(0)], deadline=time.monotonic() + 10) == [True]
