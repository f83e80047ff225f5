"""Write dedup: a put of a key a tier already holds is skipped cheaply and counted.

Blocks are content-addressed and immutable (same key, same bytes), so every
tier may skip such a put: the CPU tier by a dict check, the disk tier by the
file's existence, the Aerospike tier by a batched check before uploading, the
remote tier by one Exists call. The Aerospike test that measures what the
client uploads counts the bytes at the emulator; the others run on the test
run's real server (tests/support/aerospike_target.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.metrics import StoreMetrics
from kvtier.store import TieredStore
from kvtier.tiers.aerospike import AerospikeTier
from kvtier.tiers.aerospike_config import AerospikeTierConfig
from kvtier.tiers.aerospike_layout import Manifest
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.disk import DiskTier
from tests.kvtier.helpers import block, key
from tests.server.helpers import remote, running_server, sized_block
from tests.support.aerospike_server import AerospikeTestServer
from tests.support.aerospike_target import Target, make_target
from tests.support.timeouts import scaled, scaled_ms

KiB, MiB = 1024, 1024 * 1024
SKIPPED = "kvtier_tier_puts_skipped_total"
SKIPPED_BYTES = "kvtier_tier_put_skipped_bytes_total"


def skipped(metrics: StoreMetrics, tier: str) -> tuple[float, float]:
    return metrics.value(SKIPPED, {"tier": tier}), metrics.value(SKIPPED_BYTES, {"tier": tier})


@pytest.fixture
def server() -> Iterator[AerospikeTestServer]:
    with AerospikeTestServer() as srv:
        yield srv


def aerospike_tier(
    srv: AerospikeTestServer | Target, metrics: StoreMetrics | None = None
) -> AerospikeTier:
    names = (
        {"namespace": srv.namespace, "set_name": srv.set_name} if isinstance(srv, Target) else {}
    )
    cfg = AerospikeTierConfig(
        hosts=[srv.address],  # type: ignore[list-item]
        **names,  # type: ignore[arg-type]
        skip_existing=True,  # off by default: a put is then one request
        total_timeout_ms=scaled_ms(1000),
        write_timeout_ms=scaled_ms(2000),
        socket_timeout_ms=scaled_ms(500),
    )
    return AerospikeTier(cfg, metrics)


def record(tier: AerospikeTier, k: bytes) -> Manifest | None:
    """The manifest stored under chunk key ``k`` (``None`` for a single-record block)."""
    ((code, rec),) = tier._read_rows(tier._client, "test", [k], None, tier._exists_policy)
    assert code == 0
    return Manifest.decode(rec[2]["m"]) if "m" in rec[2] else None


def prefix() -> list[tuple[bytes, bytes]]:
    """A saved prefix: small chunks (one record each) and large ones (segments + manifest)."""
    sizes = [300 * KiB] * 6 + [int(2.5 * MiB)] * 4
    return [(key(i), sized_block(i, n)) for i, n in enumerate(sizes)]


def test_cpu_tier_skips_a_held_key() -> None:
    metrics = StoreMetrics()
    cpu = CpuTier(1 * MiB, metrics=metrics)
    assert cpu.put([(key(0), block(0))]) == [True]
    assert cpu.put([(key(0), block(0)), (key(1), block(1))]) == [True, True]
    assert skipped(metrics, "cpu") == (1, len(block(0)))
    assert cpu.skipped_writes == 1
    cpu.check_integrity()


def test_disk_tier_skips_a_key_whose_file_exists(tmp_path: Path) -> None:
    root = tmp_path / "d"
    metrics = StoreMetrics()
    writer = DiskTier(root, 1 * MiB)
    assert writer.put([(key(0), block(0))]) == [True]
    path = next((root / "blocks").rglob("*.kvb"))
    before = path.stat()
    other = DiskTier(root, 1 * MiB, metrics=metrics, rescan_s=3600)
    writer.put([(key(1), block(1))])  # written after `other` scanned: unknown to it
    assert other.put([(key(0), block(0)), (key(1), block(1))]) == [True, True]
    assert skipped(metrics, "disk") == (2, len(block(0)) + len(block(1)))
    assert path.stat().st_ino == before.st_ino  # not rewritten
    assert path.stat().st_mtime_ns == before.st_mtime_ns


@pytest.mark.aerospike_emulator("counts the bytes the client uploads, at the server")
def test_a_second_store_uploads_almost_nothing_of_a_saved_prefix(
    server: AerospikeTestServer,
) -> None:
    items = prefix()
    total = sum(len(b) for _, b in items)
    sent: list[int] = []
    metrics: list[StoreMetrics] = []
    for _ in range(2):  # two engines saving the same prompt prefix
        m = StoreMetrics()
        store = TieredStore([CpuTier(64 * MiB, metrics=m), aerospike_tier(server, m)], metrics=m)
        server.reset_counts()
        store.put(items)
        assert store.flush(scaled(30))
        sent.append(server.bytes_received)
        metrics.append(m)
        store.close()
    first, second = sent
    ratio = second / first
    print(f"aerospike bytes uploaded: first {first}, second {second}, ratio {ratio:.5f}")
    assert first >= total  # the first store uploaded every block
    assert ratio <= 0.05
    assert skipped(metrics[0], "aerospike") == (0, 0)
    assert skipped(metrics[1], "aerospike") == (len(items), total)
    reader = aerospike_tier(server)
    assert reader.get([k for k, _ in items]) == [b for _, b in items]
    reader.close()


def test_an_incomplete_block_is_uploaded_again() -> None:
    target = make_target()
    big = [(key(i), sized_block(i, 3 * MiB)) for i in range(3)]
    small = (key(9), sized_block(9, 100 * KiB))
    tier = aerospike_tier(target)
    assert tier.put([*big, small]) == [True] * 4
    # Block 0: one segment evicted. Block 1: the manifest gone (as if its writer died before
    # committing it). Block 2 and the single-record block: complete.
    m0 = record(tier, big[0][0])
    assert m0 is not None and m0.n_segments >= 3
    assert target.remove(m0.segment_keys(big[0][0])[1])
    assert target.remove(big[1][0])
    metrics = StoreMetrics()
    again = aerospike_tier(target, metrics)
    assert again.put([*big, small]) == [True] * 4
    assert skipped(metrics, "aerospike")[0] == 2  # block 2 and the small one
    # block 0's manifest: young (cleanup_grace_s), so kept; the put re-created the missing
    # segment with the same bytes under it
    assert again.stats().broken_manifests == 1
    assert again.get([k for k, _ in big] + [small[0]]) == [b for _, b in big] + [small[1]]
    tier.close()
    again.close()
    target.close()


def test_remote_tier_sends_only_what_the_server_lacks() -> None:
    with running_server() as server:
        metrics = StoreMetrics()
        tier = remote(server, metrics=metrics)
        held = [(key(i), block(i)) for i in range(4)]
        assert tier.put(held) == [True] * 4
        fresh = [(key(i), block(i)) for i in range(4, 6)]
        assert tier.put(held[:3] + fresh) == [True] * 5
        assert skipped(metrics, "remote") == (3, sum(len(b) for _, b in held[:3]))
        assert tier.get([k for k, _ in fresh]) == [b for _, b in fresh]
        tier.close()
