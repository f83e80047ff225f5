from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

from kvtier.errors import (
    ConfigError,
    DeadlineExceededError,
    TierUnavailableError,
    TransientError,
)
from kvtier.metrics import StoreMetrics
from kvtier.store import TieredStore, WritePolicy
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.disk import DiskTier
from tests.kvtier.helpers import FlakyTier, block, key

BLOCK_LEN = len(block(0))


def ops(m: StoreMetrics, tier: str, op: str, outcome: str) -> float:
    return m.value("kvtier_tier_ops_total", {"tier": tier, "op": op, "outcome": outcome})


def make(
    tmp_path: Path,
    policy: WritePolicy = WritePolicy.WRITE_THROUGH,
    cpu_blocks: int = 4,
    **kw: object,
) -> TieredStore:
    return TieredStore(
        [CpuTier(BLOCK_LEN * cpu_blocks), DiskTier(tmp_path / "disk", BLOCK_LEN * 100)],
        write_policy=policy,
        **kw,  # type: ignore[arg-type]
    )


def test_lookup_is_prefix_across_tiers(tmp_path: Path) -> None:
    with make(tmp_path) as s:
        cpu, disk = s.tiers
        cpu.put([(key(0), block(0)), (key(2), block(2))])
        disk.put([(key(1), block(1)), (key(3), block(3))])
        keys = [key(i) for i in range(6)]
        assert s.lookup(keys) == 4  # 0 cpu, 1 disk, 2 cpu, 3 disk, 4 missing
        assert s.lookup([key(9), *keys]) == 0
        assert s.lookup([]) == 0
        m = s.metrics
        assert m.value("kvtier_lookups_total", {"outcome": "partial"}) == 1
        assert m.value("kvtier_lookups_total", {"outcome": "miss"}) == 1
        assert m.value("kvtier_lookup_keys_total", {"kind": "hit"}) == 4
        s.check_integrity()


def test_write_through_reaches_every_tier(tmp_path: Path) -> None:
    with make(tmp_path) as s:
        s.put([(key(i), block(i)) for i in range(3)])
        assert s.flush(5)
        assert s.tiers[0].contains([key(0), key(1), key(2)]) == [True] * 3
        assert s.tiers[1].contains([key(0), key(1), key(2)]) == [True] * 3
        s.check_integrity()


def test_get_promotes_lower_tier_hits(tmp_path: Path) -> None:
    with make(tmp_path) as s:
        s.tiers[1].put([(key(7), block(7))])
        assert s.get([key(7), key(8)]) == [block(7), None]
        assert s.tiers[0].contains([key(7)]) == [True]
        assert s.metrics.value("kvtier_promotions_total", {"tier": "cpu"}) == 1
        assert ops(s.metrics, "disk", "get", "hit") == 1
        assert ops(s.metrics, "disk", "get", "miss") == 1
        s.check_integrity()


def test_write_back_writes_down_on_eviction_and_close(tmp_path: Path) -> None:
    s = make(tmp_path, WritePolicy.WRITE_BACK, cpu_blocks=2)
    s.put([(key(0), block(0)), (key(1), block(1))])
    assert s.flush(5)
    assert s.tiers[1].usage().num_blocks == 0  # nothing written down yet
    s.put([(key(2), block(2))])  # evicts key 0 from the CPU tier
    assert s.flush(5)
    assert s.tiers[1].contains([key(0), key(1), key(2)]) == [True, False, False]
    s.check_integrity()
    s.close()  # writes the CPU tier's blocks down
    disk = DiskTier(tmp_path / "disk", BLOCK_LEN * 100)
    assert disk.get([key(0), key(1), key(2)]) == [block(0), block(1), block(2)]


def test_selective_writes_down_after_n_hits(tmp_path: Path) -> None:
    with make(tmp_path, WritePolicy.SELECTIVE, selective_hits=2) as s:
        s.put([(key(0), block(0)), (key(1), block(1))])
        s.get([key(0)])
        assert s.flush(5)
        assert s.tiers[1].contains([key(0)]) == [False]
        s.get([key(0), key(1)])
        assert s.flush(5)
        assert s.tiers[1].contains([key(0), key(1)]) == [True, False]


def test_slow_tier_never_blocks_put_and_full_queue_drops(tmp_path: Path) -> None:
    gate = threading.Event()
    stuck = GatedTier(gate)
    with TieredStore([CpuTier(BLOCK_LEN * 50), stuck], writer_queue=2) as s:
        putter = threading.Thread(target=lambda: [s.put([(key(i), block(i))]) for i in range(10)])
        putter.start()
        putter.join(timeout=10)
        assert not putter.is_alive()  # every put returned while the lower tier is stuck
        dropped = s.metrics.value("kvtier_writer_dropped_total", {"tier": "gated"})
        # the writer drains up to a queue's worth (2) into the batch the tier holds, two more
        # queue behind it: at most 4 of the 10 are not dropped
        assert dropped >= 6
        assert s.tiers[0].contains([key(i) for i in range(10)]) == [True] * 10
        gate.set()
        assert s.flush(5)
        assert len(stuck.data) == 10 - dropped


class GatedTier(FlakyTier):
    """Holds every put until the gate opens."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__("gated")
        self.gate = gate

    def put(self, items):  # type: ignore[no-untyped-def]
        self.gate.wait(timeout=30)
        return super().put(items)


@pytest.mark.parametrize("error", [TransientError("timeout"), TierUnavailableError("breaker open")])
def test_failing_tier_is_a_counted_miss(error: Exception) -> None:
    bad = FlakyTier("remote")
    bad.data[key(1)] = block(1)
    bad.fail = error
    with TieredStore([CpuTier(BLOCK_LEN * 10), bad]) as s:
        s.tiers[0].put([(key(0), block(0))])
        assert s.lookup([key(0), key(1)]) == 1
        assert s.get([key(0), key(1)]) == [block(0), None]
        kind = "unavailable" if isinstance(error, TierUnavailableError) else "transient"
        assert s.metrics.value("kvtier_tier_errors_total", {"tier": "remote", "kind": kind}) == 2
        s.put([(key(2), block(2))])
        s.flush(5)
        assert ops(s.metrics, "remote", "put", "error") == 1
        bad.fail = None  # recovers
        assert s.get([key(1)]) == [block(1)]


def test_corrupt_block_from_a_tier_is_deleted_and_counted() -> None:
    lower = FlakyTier("remote")
    bad = bytearray(block(1))
    bad[-1] ^= 1
    lower.data[key(1)] = bytes(bad)
    lower.data[key(2)] = b"garbage"
    with TieredStore([CpuTier(BLOCK_LEN * 10), lower]) as s:
        assert s.get([key(1), key(2)]) == [None, None]
        assert key(1) not in lower.data and key(2) not in lower.data
        assert s.metrics.value("kvtier_corrupt_blocks_total", {"tier": "remote"}) == 2
        assert s.tiers[0].usage().num_blocks == 0  # nothing corrupt was promoted


def test_store_rejects_bad_construction() -> None:
    with pytest.raises(ConfigError):
        TieredStore([])
    with pytest.raises(ConfigError):
        TieredStore([CpuTier(100), CpuTier(100)])


def test_concurrent_mutation_keeps_integrity(tmp_path: Path) -> None:
    errors: list[BaseException] = []
    with make(tmp_path, cpu_blocks=6) as s:
        deadline = time.monotonic() + 3

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(100):
                    if time.monotonic() > deadline:
                        return
                    i = rng.randrange(30)
                    r = rng.random()
                    if r < 0.4:
                        s.put([(key(i), block(i))])
                    elif r < 0.8:
                        got = s.get([key(i)])[0]
                        assert got is None or got == block(i)
                    elif r < 0.95:
                        s.lookup([key(i), key(i + 1)])
                    else:
                        s.delete([key(i)])
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        s.flush(10)
        s.check_integrity()


def test_delete_wins_over_queued_and_in_flight_writes() -> None:
    slow = FlakyTier("slow", delay=0.3)
    with TieredStore([CpuTier(BLOCK_LEN * 50), slow], writer_queue=64) as s:
        for i in range(4):
            s.put([(key(i), block(i))])
        time.sleep(0.1)  # key 0 (and maybe more) is now being written by the slow tier
        s.delete([key(i) for i in range(4)])
        s.put([(key(9), block(9))])  # a write after the delete still happens
        assert s.flush(10)
        assert slow.data.keys() == {key(9)}
        assert s.get([key(i) for i in range(4)]) == [None] * 4
        # Deleting again later re-arms nothing: a new put of the same key is stored.
        s.put([(key(0), block(0))])
        assert s.flush(10)
        assert key(0) in slow.data


def test_get_hands_each_tier_what_is_left_of_one_deadline() -> None:
    upper = FlakyTier("upper", delay=0.3)
    lower = FlakyTier("lower")
    lower.data[key(1)] = block(1)
    with TieredStore([CpuTier(BLOCK_LEN * 10), upper, lower]) as s:
        s.tiers[0].put([(key(0), block(0))])
        start = time.monotonic()
        deadline = start + 5.0
        assert s.get([key(0), key(1)], deadline=deadline) == [block(0), block(1)]
        [(_, got_upper, left_upper)] = upper.deadlines
        [(_, got_lower, left_lower)] = lower.deadlines
        assert got_upper == got_lower == deadline  # one instant for the whole get
        assert left_upper is not None and left_lower is not None
        assert left_lower <= deadline - start - 0.3  # the slow upper tier's time is gone
        assert left_lower < left_upper
        assert s.tiers[0].contains([key(1)]) == [True]  # a late hit is still promoted
        upper.deadlines.clear()
        lower.deadlines.clear()
        assert s.lookup([key(0), key(1), key(2)], deadline=deadline) == 2
        assert s.contains([key(2)], deadline=deadline) == [False]
        assert [d for _, d, _ in upper.deadlines + lower.deadlines] == [deadline] * 4


def test_without_a_deadline_tiers_are_called_as_before() -> None:
    lower = FlakyTier("lower")
    with TieredStore([CpuTier(BLOCK_LEN * 10), lower]) as s:
        s.get([key(1)])
        s.lookup([key(1)])
        s.contains([key(1)])
        assert [d for _, d, _ in lower.deadlines] == [None] * 3


class OldTier(FlakyTier):
    """A tier written before deadlines: its reads take no ``deadline`` keyword."""

    def contains(self, keys):  # type: ignore[override]
        return super().contains(keys)

    def get(self, keys):  # type: ignore[override]
        return super().get(keys)


def test_a_tier_without_deadlines_still_works_without_one() -> None:
    old = OldTier("old")
    old.data[key(1)] = block(1)
    with TieredStore([CpuTier(BLOCK_LEN * 10), old]) as s:
        assert s.lookup([key(1)]) == 1
        assert s.get([key(1)]) == [block(1)]
        assert old.prefix_length([key(1), key(2)]) == 1


@pytest.mark.parametrize(
    "error", [DeadlineExceededError("late"), TransientError("attempt timed out at the deadline")]
)
def test_a_tier_out_of_time_is_a_counted_miss(error: Exception) -> None:
    late = FlakyTier("remote")
    late.data[key(1)] = block(1)
    late.fail = error
    with TieredStore([CpuTier(BLOCK_LEN * 10), late]) as s:
        s.tiers[0].put([(key(0), block(0))])
        deadline = time.monotonic() + 5
        assert s.get([key(0), key(1)], deadline=deadline) == [block(0), None]
        assert s.lookup([key(0), key(1)], deadline=deadline) == 1
        assert (
            s.metrics.value("kvtier_tier_errors_total", {"tier": "remote", "kind": "transient"})
            == 2
        )


def test_a_past_deadline_still_serves_memory_and_skips_io(tmp_path: Path) -> None:
    with make(tmp_path, cpu_blocks=1) as s:
        s.put([(key(0), block(0)), (key(1), block(1))])  # key 1 pushes key 0 out of the CPU tier
        assert s.flush(5)
        past = time.monotonic() - 1
        assert s.get([key(0), key(1)], deadline=past) == [None, block(1)]
        assert s.get([key(0), key(1)]) == [block(0), block(1)]
