"""The Aerospike tier's one-request put: segments and the manifest naming them in one batch.

A reader can therefore meet a manifest whose segments have not landed yet (a write in
flight) or never will (a writer that died, a segment row that failed). These tests pin
what makes that safe: such a read is a miss, never wrong bytes; a reader removes such a
manifest only once the server last wrote it longer ago than ``cleanup_grace_s``; a writer
whose segment failed removes its own manifest; concurrent writers of one chunk leave
exactly one writer's complete block. They run against the test run's real server (the
grace is a server-side filter expression, which the emulator does not evaluate).
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvtier.block import activation_like_kv, encode_block
from kvtier.store import TieredStore
from kvtier.tiers.aerospike import AerospikeTier
from kvtier.tiers.aerospike_config import AerospikeTierConfig
from kvtier.tiers.aerospike_errors import STOP_WRITES
from kvtier.tiers.aerospike_layout import (
    BIN_MANIFEST,
    BIN_SEGMENT,
    BIN_TAG,
    CHECKSUM_KVTB,
    Manifest,
    canonical_nonce,
    segment_key,
)
from kvtier.tiers.cpu import CpuTier
from tests.support.aerospike_target import InProcessTarget, Target, make_target
from tests.support.timeouts import aerospike_timeouts

KiB = 1024
SEG = 16 * KiB


@pytest.fixture
def target() -> Iterator[Target]:
    t = make_target()
    if isinstance(t, InProcessTarget):
        t.close()
        pytest.skip("needs a real server: the cleanup grace is a filter expression")
    yield t
    t.close()


def make_tier(target: Target, **overrides: Any) -> AerospikeTier:
    overrides.setdefault("set_name", target.set_name)
    overrides.setdefault("namespace", target.namespace)
    overrides.setdefault("segment_size", SEG)
    for name, value in aerospike_timeouts().items():
        overrides.setdefault(name, value)
    return AerospikeTier(AerospikeTierConfig(hosts=[target.address], **overrides))


def rand_bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def manifest_of(tier: AerospikeTier, key: bytes) -> Manifest:
    ((code, rec),) = tier._read_rows(
        tier._client, "test", [key], [BIN_MANIFEST], tier._exists_policy
    )
    assert code == 0
    return Manifest.decode(rec[2][BIN_MANIFEST])


def test_a_put_is_one_request_of_segments_and_manifest(target: Target) -> None:
    tier = make_tier(target)
    key, block = os.urandom(16), rand_bytes(100 * KiB, 1)
    before = tier.stats().round_trips
    assert tier.put([(key, block)]) == [True]
    assert tier.stats().round_trips - before == 1
    assert manifest_of(tier, key).nonce == canonical_nonce(key)
    assert target.record_count() == 7 + 1
    assert make_tier(target).get([key]) == [block]
    tier.close()


def test_a_reader_never_removes_a_write_in_flight(target: Target) -> None:
    """The writer's manifest lands before its segments (the server may apply the rows of
    one request in any order): a reader then misses, and must not remove what the writer
    is about to acknowledge."""
    writer, reader = make_tier(target), make_tier(target)  # reader: cleanup_grace_s 60
    key, block = os.urandom(16), rand_bytes(200 * KiB, 2)
    seen: list[bytes | None] = []
    real = writer._write_batch

    def manifest_first(client, op, records, deadline=None):
        if op != "put":
            return real(client, op, records, deadline)
        *segments, manifest = records
        first = real(client, op, [manifest], deadline)
        seen.extend(reader.get([key]))  # the manifest is there, no segment yet
        return real(client, op, segments, deadline) + first

    writer._write_batch = manifest_first  # type: ignore[method-assign]
    assert writer.put([(key, block)]) == [True]
    assert seen == [None]
    assert reader.stats().broken_manifests == 1
    assert reader.get([key]) == [block]  # acknowledged, and still there
    for t in (writer, reader):
        t.close()


def test_a_failed_segment_takes_the_writers_manifest_with_it(target: Target) -> None:
    """One segment row of the request fails (stop-writes on its node) while the manifest
    lands: the put answers False and removes its manifest and the segments it created."""
    tier = make_tier(target)
    key, block = os.urandom(16), rand_bytes(100 * KiB, 3)
    real = tier._write_batch

    def one_row_refused(client, op, records, deadline=None):
        if op != "put":
            return real(client, op, records, deadline)
        codes = real(client, op, records[:2] + records[3:], deadline)
        return [*codes[:2], STOP_WRITES, *codes[2:]]

    tier._write_batch = one_row_refused  # type: ignore[method-assign]
    assert tier.put([(key, block)]) == [False]
    assert tier.stats().stop_writes_drops == 1
    assert target.record_count() == 0
    assert make_tier(target).get([key]) == [None]
    tier._write_batch = real  # type: ignore[method-assign]
    assert tier.put([(key, block)]) == [True]
    assert make_tier(target).get([key]) == [block]
    tier.close()


def test_taken_canonical_segments_with_our_bytes_are_kept(target: Target) -> None:
    """A canonical segment key already holds this block's own bytes (a concurrent writer of
    the same KV): the writer checks them and keeps its canonical manifest, no orphans."""
    tier = make_tier(target)
    key, block = os.urandom(16), rand_bytes(60 * KiB, 4)
    target.overwrite(segment_key(key, canonical_nonce(key), 1), BIN_SEGMENT, block[SEG : 2 * SEG])
    assert tier.put([(key, block)]) == [True]
    assert manifest_of(tier, key).nonce == canonical_nonce(key)
    assert target.record_count() == 4 + 1
    assert tier.stats().orphan_cleanups == 0
    assert make_tier(target).get([key]) == [block]
    tier.close()


def test_a_segment_the_winner_kept_is_not_removed_by_the_loser(target: Target) -> None:
    """Writers A and B store blocks that agree in segment 1 and differ in segment 0. B's
    segment 1 lands first; A's request finds it taken, reads it back (its own bytes) and
    keeps it under A's manifest. B's manifest then loses: B's put answers False and must
    leave its segment 1 alone — A's block needs it."""
    a, b = make_tier(target), make_tier(target)
    key = os.urandom(16)
    block_a = rand_bytes(60 * KiB, 6)
    block_b = bytes([block_a[0] ^ 0xFF]) + block_a[1:]  # segment 0 differs
    real = b._write_batch

    def a_in_between(client, op, records, deadline=None):
        if op != "put":
            return real(client, op, records, deadline)
        first = real(client, op, [records[1]], deadline)  # B's segment 1 lands
        assert a.put([(key, block_a)]) == [True]
        rest = real(client, op, [records[0], *records[2:]], deadline)
        return [rest[0], *first, *rest[1:]]

    b._write_batch = a_in_between  # type: ignore[method-assign]
    assert b.put([(key, block_b)]) == [False]
    assert manifest_of(a, key).nonce == canonical_nonce(key)
    assert make_tier(target).get([key]) == [block_a]
    assert target.record_count() == 4 + 1
    for t in (a, b):
        t.close()


def race(writers: list[AerospikeTier], key: bytes, blocks: list[bytes]) -> dict[int, bool]:
    """Every writer puts its block under ``key`` at once; what each put answered."""
    start = threading.Barrier(len(writers))
    results: dict[int, bool] = {}

    def put(w: int) -> None:
        start.wait()
        results[w] = writers[w].put([(key, blocks[w])])[0]

    threads = [threading.Thread(target=put, args=(w,)) for w in range(len(writers))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    return results


def kv_block(key: bytes, seed: int) -> bytes:
    """A kvtier block of 98,384 bytes (7 segments of SEG): a kind-2 manifest, tagged segments."""
    return encode_block(activation_like_kv((4, 2, 16, 3, 64), torch.float32, seed=seed), key=key)


@pytest.mark.parametrize("blocks_are", ["any bytes", "kvtier blocks"])
def test_concurrent_puts_of_one_key_with_different_bytes(target: Target, blocks_are: str) -> None:
    """Four writers store other bytes under one key at once, eight times over: every read
    returns exactly one writer's block, at least one put answers True, and no orphan
    segment is left behind. Any bytes are checked by their xxh3; kvtier blocks, whose
    bodies the tier does not hash, by their segments' tags."""
    writers = [make_tier(target) for _ in range(4)]
    reader = make_tier(target)
    for r in range(8):
        key = os.urandom(16)
        if blocks_are == "any bytes":
            blocks = [rand_bytes(90 * KiB, 100 * r + w) for w in range(len(writers))]
        else:
            blocks = [kv_block(key, 100 * r + w) for w in range(len(writers))]
        records = -(-len(blocks[0]) // SEG) + 1
        results = race(writers, key, blocks)
        assert len(results) == len(writers) and any(results.values())
        (got,) = reader.get([key])
        assert got in blocks, f"round {r}: a mix or a miss"
        assert target.record_count() == (r + 1) * records, f"round {r}: orphans left"
    for t in [*writers, reader]:
        t.close()


def test_another_writers_segment_under_a_kvtier_blocks_manifest_is_a_miss(
    target: Target,
) -> None:
    """A kind-2 block whose canonical segment 1 holds another block's segment (bytes and tag,
    as a concurrent writer of other KV leaves it): lengths and head agree, and the tier does
    not hash the body, so only the tag tells: a miss, the manifest removed; never the mix."""
    tier = make_tier(target, cleanup_grace_s=0)
    key = os.urandom(16)
    mine, theirs = kv_block(key, 1), kv_block(key, 2)
    assert tier.put([(key, mine)]) == [True]
    m = manifest_of(tier, key)
    assert m.kind == CHECKSUM_KVTB
    other = Manifest.for_block(theirs, SEG, nonce=canonical_nonce(key))
    victim = m.segment_keys(key)[1]
    target.overwrite(victim, BIN_SEGMENT, other.split(theirs)[1])
    target.overwrite(victim, BIN_TAG, other.tag or b"")
    reader = make_tier(target, cleanup_grace_s=0)
    assert reader.get([key]) == [None]
    assert reader.stats().broken_manifests == 1
    assert target.record_count() == 0
    for t in (tier, reader):
        t.close()


def test_a_flipped_body_bit_of_a_kvtier_block_is_the_stores_counted_miss(target: Target) -> None:
    """The tier leaves a kvtier block's body to its consumer's checksum: a flipped bit in a
    segment (its tag intact) reaches the store, which counts it corrupt, misses and removes
    the block."""
    tier = make_tier(target)
    key = os.urandom(16)
    block = kv_block(key, 3)
    assert tier.put([(key, block)]) == [True]
    victim = manifest_of(tier, key).segment_keys(key)[2]
    part = bytearray(block[2 * SEG : 3 * SEG])
    part[100] ^= 0x10
    target.overwrite(victim, BIN_SEGMENT, bytes(part))
    with TieredStore([CpuTier(1 << 20), make_tier(target)]) as store:
        assert store.get([key]) == [None]
        assert store.metrics.value("kvtier_corrupt_blocks_total", {"tier": "aerospike"}) == 1
    assert target.record_count() == 0  # removed (report_bad)
    tier.close()
