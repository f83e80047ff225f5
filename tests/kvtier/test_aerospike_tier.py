"""The Aerospike tier through the official client: layout, round trips, concurrency, crashes,
recency.

Tests taking ``target`` run against the test run's real Aerospike server (a
cluster started from ``../shared/aerospike``, or ``KVTIER_AEROSPIKE_HOST``),
else the emulator (tests/support/aerospike_target.py). Tests taking
``server`` need a wire-level fault of the emulator and say which.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.block import activation_like_kv, encode_block, verify_block
from kvtier.errors import TransientError
from kvtier.metrics import StoreMetrics
from kvtier.tiers.aerospike import AerospikeTier
from kvtier.tiers.aerospike_config import AerospikeTierConfig
from kvtier.tiers.aerospike_layout import (
    BIN_MANIFEST,
    BIN_SEGMENT,
    Manifest,
    canonical_nonce,
    segment_key,
)
from tests.support.aerospike_server import AerospikeTestServer
from tests.support.aerospike_target import InProcessTarget, Target, make_target
from tests.support.timeouts import aerospike_timeouts

KiB, MiB = 1024, 1024 * 1024


@pytest.fixture
def server() -> Iterator[AerospikeTestServer]:
    with AerospikeTestServer() as srv:
        yield srv


@pytest.fixture
def target() -> Iterator[Target]:
    t = make_target()
    yield t
    t.close()


def make_tier(srv: AerospikeTestServer | Target, **overrides: object) -> AerospikeTier:
    if isinstance(srv, Target):
        overrides.setdefault("set_name", srv.set_name)
        overrides.setdefault("namespace", srv.namespace)
    for name, value in aerospike_timeouts().items():  # a busy host must not fail these
        overrides.setdefault(name, value)
    cfg = AerospikeTierConfig(hosts=[srv.address], **overrides)  # type: ignore[arg-type]
    return AerospikeTier(cfg)


def rand_bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def record_count(srv: AerospikeTestServer) -> int:
    return len(srv.digests("kvcache"))


@pytest.mark.parametrize("cap", [128 * KiB, 1 * MiB, 8 * MiB])
def test_round_trip_sizes_under_record_caps(cap: int) -> None:
    target = make_target(max_record_size=cap)
    tier = make_tier(target)
    try:
        limits = tier.limits
        assert limits is not None and limits.max_record_size == cap
        seg = limits.segment_size
        sizes = [4 * KiB, seg - 1, seg, seg + 1, 2 * seg + 7, 3 * MiB]
        items = [(os.urandom(16), rand_bytes(n, n)) for n in sizes]
        assert tier.put(items) == [True] * len(items)
        expected_records = sum(1 if n <= seg else -(-n // seg) + 1 for n in sizes)
        assert target.record_count() == expected_records
        got = tier.get([k for k, _ in items])
        assert [g == b for g, (_, b) in zip(got, items, strict=True)] == [True] * len(items)
        assert tier.stats().segmented_reads == sum(n > seg for n in sizes)
    finally:
        tier.close()
        target.close()


@pytest.mark.parametrize("cap", [128 * KiB, 8 * MiB])
def test_32mib_encoded_block_round_trips(cap: int) -> None:
    # [layers, 2, tokens, kv_heads, head_dim] bf16: 32 * 2 * 256 * 8 * 128 * 2 B = 32 MiB
    kv = activation_like_kv((32, 2, 256, 8, 128), torch.bfloat16, seed=cap)
    key = os.urandom(16)
    block = encode_block(kv, key=key)
    assert len(block) > 32 * MiB
    target = make_target(max_record_size=cap)
    tier = make_tier(target)
    try:
        before = tier.stats().round_trips
        assert tier.put([(key, block)]) == [True]
        # Every segment and the manifest in ONE batch write (no dedup check by default).
        assert tier.stats().round_trips - before == 1
        # Another engine's tier: one read of the chunk key, then every segment in ONE batch.
        reader = make_tier(target)
        before = reader.stats().round_trips
        rows_before = (
            target.server.counts["batch_rows"] if isinstance(target, InProcessTarget) else 0
        )
        (got,) = reader.get([key])
        assert got == block
        verify_block(got)
        assert reader.stats().round_trips - before == 2
        if isinstance(target, InProcessTarget):
            assert target.server.counts["batch_rows"] - rows_before == -(
                -len(block) // tier.limits.segment_size
            )  # type: ignore[union-attr]
            assert target.server.largest_message < 128 * MiB
        # Once a tier has seen a manifest of this size it asks for the chunk key and the
        # canonical segments together: ONE round trip.
        before = reader.stats().round_trips
        assert reader.get([key]) == [block]
        assert reader.stats().round_trips - before == 1
        reader.close()
    finally:
        tier.close()
        target.close()


def test_small_blocks_are_one_record_and_one_round_trip(target: Target) -> None:
    tier = make_tier(target)
    items = [(os.urandom(16), rand_bytes(8 * KiB, i)) for i in range(20)]
    before = tier.stats().round_trips
    assert tier.put(items) == [True] * 20
    assert tier.stats().round_trips - before == 1  # one batch write
    assert tier.get([k for k, _ in items]) == [b for _, b in items]
    assert tier.stats().round_trips - before == 2
    assert target.record_count() == 20
    tier.close()
    asking = make_tier(target, skip_existing=True)
    more = [(os.urandom(16), rand_bytes(8 * KiB, i)) for i in range(20, 25)]
    before = asking.stats().round_trips
    assert asking.put(more) == [True] * 5
    assert asking.stats().round_trips - before == 2  # the dedup check, then one batch write
    asking.close()


def test_keys_differing_after_a_nul_byte_are_distinct(target: Target) -> None:
    # The Python client hashes a ``bytes`` key as a C string; the tier must not.
    tier = make_tier(target)
    keys = [b"\x00" * 15 + bytes([i]) for i in range(4)] + [
        b"ab\x00" + bytes(13),
        b"ab\x00" + b"\x01" * 13,
    ]
    items = [(k, rand_bytes(1000, i)) for i, k in enumerate(keys)]
    assert tier.put(items) == [True] * len(items)
    assert target.record_count() == len(keys)
    assert tier.get(keys) == [b for _, b in items]
    tier.close()


def test_contains_and_prefix_length_take_one_round_trip(target: Target) -> None:
    """One client call each (the client splits a batch by node; that is still one round trip)."""
    tier = make_tier(target, segment_size=16 * KiB)
    keys = [os.urandom(16) for _ in range(60)]
    present = keys[:25] + keys[26:40]
    tier.put(
        [(k, rand_bytes(40 * KiB if i % 5 == 0 else 2 * KiB, i)) for i, k in enumerate(present)]
    )
    before = tier.stats().round_trips
    assert tier.contains(keys) == [k in present for k in keys]
    assert tier.stats().round_trips - before == 1
    assert tier.prefix_length(keys) == 25
    assert tier.stats().round_trips - before == 2
    if isinstance(target, InProcessTarget):  # the emulator also counts at the server
        target.server.reset_counts()
        tier.contains(keys)
        assert target.server.counts["batch"] == 1 and target.server.counts["batch_rows"] == 60
    reader = make_tier(target)  # another engine's
    before = reader.stats().round_trips
    reader.get(keys)
    assert reader.stats().round_trips - before == 2  # chunk keys, then all segments
    before = tier.stats().round_trips
    tier.get(keys)  # the writer knows the segment count: chunk keys and segments at once
    assert tier.stats().round_trips - before == 1
    reader.close()
    tier.close()


def test_delete_removes_blocks_and_their_segments(target: Target) -> None:
    tier = make_tier(target, segment_size=16 * KiB)
    items = [(os.urandom(16), rand_bytes(n, n)) for n in (1000, 100 * KiB, 50 * KiB)]
    tier.put(items)
    assert target.record_count() == 1 + (7 + 1) + (4 + 1)
    assert tier.delete([k for k, _ in items] + [os.urandom(16)]) == 3
    assert target.record_count() == 0
    assert tier.get([k for k, _ in items]) == [None, None, None]
    assert tier.delete([items[0][0]]) == 0
    tier.close()


def test_rewriting_a_key_is_harmless(target: Target) -> None:
    tier = make_tier(target, segment_size=16 * KiB)
    key, block = os.urandom(16), rand_bytes(70 * KiB, 1)
    assert tier.put([(key, block)]) == [True]
    records = target.record_count()
    assert tier.put([(key, block)]) == [True]  # the second writer's segments are cleaned up
    assert target.record_count() == records
    assert tier.get([key]) == [block]
    tier.close()


def test_a_put_sent_after_another_writers_finds_the_chunk_held(target: Target) -> None:
    """Writer A is held just before its one request while writer B stores the same chunk
    with *different* bytes: A's create-only rows all find records, A stores nothing and
    answers True (the chunk is held), and readers get B's block, never a mix."""
    a, b = make_tier(target, segment_size=8 * KiB), make_tier(target, segment_size=8 * KiB)
    key = os.urandom(16)
    block_a, block_b = rand_bytes(50 * KiB, 1), rand_bytes(50 * KiB, 2)
    paused, resume = threading.Event(), threading.Event()
    real = a._write_batch

    def held(client, op, records, deadline=None):  # type: ignore[no-untyped-def]
        if op == "put":
            paused.set()
            assert resume.wait(10)
        return real(client, op, records, deadline)

    a._write_batch = held  # type: ignore[method-assign]
    result: list[list[bool]] = []
    thread = threading.Thread(target=lambda: result.append(a.put([(key, block_a)])))
    thread.start()
    assert paused.wait(10)
    assert b.put([(key, block_b)]) == [True]
    resume.set()
    thread.join(10)
    assert result == [[True]]
    reader = make_tier(target)
    assert reader.get([key]) == [block_b]
    n_segments = -(-len(block_b) // (8 * KiB))
    assert target.record_count() == n_segments + 1
    assert a.stats().orphan_cleanups == 0  # it created nothing
    for t in (a, b, reader):
        t.close()


def test_concurrent_writers_of_the_same_chunks(target: Target) -> None:
    tiers = [make_tier(target, segment_size=8 * KiB) for _ in range(3)]
    items = [(os.urandom(16), rand_bytes(40 * KiB, i)) for i in range(4)]
    start = threading.Barrier(len(tiers))
    results: list[list[bool]] = []

    def writer(t: AerospikeTier) -> None:
        start.wait()
        results.append(t.put(items))

    threads = [threading.Thread(target=writer, args=(t,)) for t in tiers]
    for th in threads:
        th.start()
    for th in threads:
        th.join(20)
    assert results == [[True] * 4] * 3
    assert tiers[0].get([k for k, _ in items]) == [b for _, b in items]
    assert target.record_count() == 4 * (5 + 1)  # no orphans left behind
    for t in tiers:
        t.close()


def test_taken_canonical_keys_make_a_writer_use_a_random_nonce(target: Target) -> None:
    """Segments already under a chunk's canonical keys (a dead writer's) are never named by
    another writer's manifest: it writes its own under a random nonce."""
    tier = make_tier(target, segment_size=16 * KiB)
    key, block = os.urandom(16), rand_bytes(60 * KiB, 11)
    stale = segment_key(key, canonical_nonce(key), 1)
    target.overwrite(stale, BIN_SEGMENT, b"left by a writer that died")
    assert tier.put([(key, block)]) == [True]
    (raw,) = tier._read_rows(tier._client, "test", [key], [BIN_MANIFEST], tier._exists_policy)
    assert Manifest.decode(raw[1][2][BIN_MANIFEST]).nonce != canonical_nonce(key)
    # no manifest names the canonical segments now: the ones this put created and the stale
    # one are removed
    assert target.record_count() == 1 + 4
    assert make_tier(target).get([key]) == [block]
    assert tier.get([key]) == [block]  # speculates, finds another nonce, reads its segments
    tier.close()


def test_a_manifest_whose_segments_were_evicted_is_not_taken_for_ours(target: Target) -> None:
    """Writer A's segments are evicted, its manifest stays; writer B (no dedup check) creates
    the canonical segments anew with other bytes: A's manifest now names B's bytes. B's put
    must not answer True, and no reader returns those mixed bytes."""
    a = make_tier(target, segment_size=16 * KiB)
    b = make_tier(target, segment_size=16 * KiB, skip_existing=False)
    key = os.urandom(16)
    assert a.put([(key, rand_bytes(60 * KiB, 12))]) == [True]
    for i in range(4):
        assert target.remove(segment_key(key, canonical_nonce(key), i))  # as eviction would
    assert b.put([(key, rand_bytes(60 * KiB, 13))]) == [False]
    # a reader that cleans up at once (the broken manifest is older than any write in flight)
    assert make_tier(target, cleanup_grace_s=0).get([key]) == [None]
    assert b.put([(key, rand_bytes(60 * KiB, 13))]) == [True]  # the broken manifest is gone
    assert make_tier(target).get([key]) == [rand_bytes(60 * KiB, 13)]
    for t in (a, b):
        t.close()


_DYING_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    from kvtier.tiers.aerospike import AerospikeTier
    from kvtier.tiers.aerospike_config import AerospikeTierConfig

    tier = AerospikeTier(AerospikeTierConfig(
        hosts=[sys.argv[1]], namespace=sys.argv[4], set_name=sys.argv[5], ttl_s=600, segment_size=16384
    ))
    real = tier._write_batch

    def write_batch(client, op, records, deadline=None):
        if op == "put":  # the manifest and the first segment land, then the writer dies
            real(client, op, [records[0], records[-1]], deadline)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(client, op, records, deadline)

    tier._write_batch = write_batch
    tier.put([(bytes.fromhex(sys.argv[2]), os.urandom(int(sys.argv[3])))])
    """
)


def test_writer_killed_mid_request_leaves_nothing_readable(target: Target, tmp_path: Path) -> None:
    """A put is one request: a writer that dies in it can leave its manifest with some of
    its segments. Readers miss; they remove that manifest and its segments only once it is
    older than their cleanup_grace_s (a younger one may be a write still in flight)."""
    script = tmp_path / "writer.py"
    script.write_text(_DYING_WRITER)
    key = os.urandom(16)
    args = [target.address, key.hex(), str(100 * KiB), target.namespace, target.set_name]
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert target.record_count() == 2  # the manifest and one of its 7 segments
    landed = time.monotonic()
    reader = make_tier(target)  # cleanup_grace_s 60 by default
    assert reader.get([key]) == [None]
    if not isinstance(target, InProcessTarget):  # the emulator has no filter expressions
        assert target.record_count() == 2  # young: spared
    patient = make_tier(target, cleanup_grace_s=1, write_timeout_ms=1000)
    time.sleep(max(0.0, landed + 1.2 - time.monotonic()))
    assert patient.get([key]) == [None]
    assert patient.stats().broken_manifests == 1
    assert target.record_count() == 0  # old enough: the manifest and its segment removed
    block = rand_bytes(100 * KiB, 21)
    assert reader.put([(key, block)]) == [True]
    assert patient.get([key]) == [block]
    for t in (reader, patient):
        t.close()


@pytest.mark.aerospike_emulator("a chosen wire-level fault: the put request's connection dropped")
def test_lost_put_request_leaves_nothing_readable(server: AerospikeTestServer) -> None:
    tier = make_tier(server, segment_size=16 * KiB, max_retries=1)
    key = os.urandom(16)
    server.drop_next(2)  # the put's one request and its retry, before they apply
    with pytest.raises(TransientError):
        tier.put([(key, rand_bytes(64 * KiB, 3))])
    assert record_count(server) == 0
    assert tier.get([key]) == [None]
    assert tier.contains([key]) == [False]
    tier.close()


@pytest.mark.aerospike_emulator("a chosen wire-level fault: a write's reply lost after it applied")
def test_in_doubt_put_retry_keeps_the_block(server: AerospikeTestServer) -> None:
    tier = make_tier(server, segment_size=16 * KiB, max_retries=2)
    key, block = os.urandom(16), rand_bytes(64 * KiB, 4)
    # The put's request (segments and manifest) lands but its reply is lost: the retry
    # finds every record there, its own.
    server.drop_next(1, after_apply=True)
    assert tier.put([(key, block)]) == [True]
    assert tier.stats().retries == 1
    assert tier.stats().orphan_cleanups == 0  # nothing removed
    assert record_count(server) == 4 + 1
    assert tier.get([key]) == [block]
    tier.close()


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_manifest_with_bad_segments_is_a_miss_and_cleaned_up(target: Target, damage: str) -> None:
    tier = make_tier(target, segment_size=16 * KiB, cleanup_grace_s=0)
    key, block = os.urandom(16), rand_bytes(60 * KiB, 5)
    tier.put([(key, block)])
    (raw,) = tier._read_rows(tier._client, "test", [key], ["m"], tier._exists_policy)
    manifest = Manifest.decode(raw[1][2]["m"])
    victim = manifest.segment_keys(key)[2]
    if damage == "missing":
        assert target.remove(victim)  # as eviction would
    else:
        part = block[2 * 16 * KiB : 3 * 16 * KiB]
        target.overwrite(victim, BIN_SEGMENT, bytes([part[0] ^ 0xFF]) + part[1:])
    assert tier.get([key]) == [None]
    assert tier.stats().broken_manifests == 1
    assert target.record_count() == 0  # manifest and surviving segments deleted
    assert tier.put([(key, block)]) == [True]
    assert tier.get([key]) == [block]
    tier.close()


def test_cleanup_spares_a_manifest_rewritten_since_it_was_read(target: Target) -> None:
    tier = make_tier(target, segment_size=16 * KiB, cleanup_grace_s=0)
    key = os.urandom(16)
    tier.put([(key, rand_bytes(60 * KiB, 6))])
    generation = target.generation(key)
    assert generation is not None
    stale_generation = generation - 1 if generation > 1 else generation + 1
    tier._cleanup_broken(tier._client, [(key, stale_generation, None)])
    assert target.generation(key) == generation
    tier._cleanup_broken(tier._client, [(key, generation, None)])
    assert target.generation(key) is None
    tier.close()


def _ttls(target: Target, tier: AerospikeTier, key: bytes) -> list[int | None]:
    """Seconds left of a block's records: its manifest (or single record), then each segment."""
    ((code, record),) = tier._read_rows(
        tier._client, "test", [key], [BIN_MANIFEST], tier._exists_policy
    )
    keys = [key]
    bins = (record[2] or {}) if code == 0 else {}
    if BIN_MANIFEST in bins:
        keys += Manifest.decode(bins[BIN_MANIFEST]).segment_keys(key)
    return [target.ttl(k) for k in keys]


def test_ttl_recency_and_expiry_on_the_servers_clock(target: Target) -> None:
    """On the server's own clock: one wait of 2.5 s, then what each recency mode did.

    TTL 10 s: a read in the last 80% of a record's life (here: after 2 s) refreshes it.
    """
    read_touch = make_tier(target, segment_size=16 * KiB, ttl_s=10, read_touch_ttl_percent=80)
    touch = make_tier(target, segment_size=16 * KiB, ttl_s=10, recency="touch")
    short = make_tier(target, ttl_s=1, recency="none")
    a, b, c, gone = (os.urandom(16) for _ in range(4))
    read_touch.put([(a, rand_bytes(40 * KiB, 7))])  # a manifest and 3 segments
    touch.put([(b, rand_bytes(40 * KiB, 8)), (c, rand_bytes(1000, 9))])
    short.put([(gone, b"x" * 100)])
    read_touch.get([a])  # early in life: no refresh
    time.sleep(2.5)
    aged = _ttls(target, read_touch, a)
    assert len(aged) == 4 and all(t is not None and t <= 8 for t in aged), aged
    read_touch.contains([a])  # contains never refreshes recency
    read_touch.prefix_length([a])
    assert all(t is not None and t <= 8 for t in _ttls(target, read_touch, a))
    assert read_touch.get([a]) == [rand_bytes(40 * KiB, 7)]
    # The server applies a read-touch after its reply: wait for it (bounded).
    deadline = time.monotonic() + 5
    while min(t or 0 for t in _ttls(target, read_touch, a)) < 9 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(
        t is not None and t >= 9 for t in _ttls(target, read_touch, a)
    )  # manifest + segments

    before = touch.stats().round_trips
    assert None not in touch.get([b, c])
    # chunk keys with the canonical segments (the writer knows their count), one batch touch
    assert touch.stats().round_trips - before == 2
    assert all(t is not None and t >= 9 for k in (b, c) for t in _ttls(target, touch, k))

    assert short.get([gone]) == [None]  # expired: the server never serves it again
    for t in (read_touch, touch, short):
        t.close()


def test_batches_are_bounded(target: Target) -> None:
    tier = make_tier(target, segment_size=32 * KiB, max_batch_bytes="256KiB", max_batch_keys=10)
    items = [(os.urandom(16), rand_bytes(200 * KiB, i)) for i in range(5)]
    if isinstance(target, InProcessTarget):
        target.server.reset_counts()
    before = tier.stats().round_trips
    assert tier.put(items) == [True] * 5
    # 5 x (7 segments of 32 KiB + a manifest), at most 256 KiB (or 10 rows) per batch write
    assert tier.stats().round_trips - before >= 5
    if isinstance(target, InProcessTarget):  # the emulator also sees each request's size
        assert target.server.largest_message < 300 * KiB
    assert tier.get([k for k, _ in items]) == [b for _, b in items]
    tier.close()


def test_usage_reports_the_set(target: Target) -> None:
    tier = make_tier(target, usage_refresh_s=0)
    assert tier.usage().used_bytes == 0
    tier.put([(os.urandom(16), b"y" * 10_000) for _ in range(3)])
    usage = tier.usage()
    assert usage.used_bytes >= 30_000  # summed over nodes: replicas count too
    assert usage.capacity_bytes == target.capacity()
    tier.close()


def test_metrics_count_round_trips(target: Target) -> None:
    metrics = StoreMetrics()
    cfg = AerospikeTierConfig(
        hosts=[target.address], namespace=target.namespace, set_name=target.set_name, name="fleet"
    )
    tier = AerospikeTier(cfg, metrics)
    key = os.urandom(16)
    tier.put([(key, b"z" * 100)])
    tier.get([key])
    tier.close()
    value = metrics.registry.get_sample_value
    assert value("kvtier_aerospike_round_trips_total", {"tier": "fleet", "op": "put"}) == 1
    assert value("kvtier_aerospike_round_trips_total", {"tier": "fleet", "op": "get"}) == 1
