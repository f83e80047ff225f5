"""Blocks are bound to their keys: a valid block read under another key is a counted, deleted miss."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import torch
import xxhash

from kvtier.block import HEADER_SIZE, check_key, decode_block, encode_block, verify_block
from kvtier.errors import CorruptBlockError, KeyMismatchError, UnsupportedVersionError
from kvtier.metrics import StoreMetrics
from kvtier.store import TieredStore
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.disk import DiskTier
from tests.kvtier.helpers import FlakyTier, block, key

BLOCK_LEN = len(block(0))


def reasons(m: StoreMetrics, tier: str, reason: str) -> float:
    return m.value("kvtier_corrupt_block_reasons_total", {"tier": tier, "reason": reason})


def v1_block(kv: torch.Tensor) -> bytes:
    """A block in the previous format (version 1: 64-byte header, no key), checksum and all."""
    layers, _, tokens, heads, head_dim = kv.shape
    payload = kv.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    fields = [b"KVTB", 1, 64, 0, 0, 2, 0, layers, heads, head_dim, 0, tokens, 0]
    fields += [len(payload), len(payload), 0, bytes(12)]
    header = struct.pack("<4sHHBBBBHHHHIIQQQ12s", *fields)
    checksum = xxhash.xxh64(header + payload).intdigest()
    return header[:44] + struct.pack("<Q", checksum) + header[52:] + payload


def test_a_block_decodes_only_for_its_own_key() -> None:
    kv = torch.randn(2, 2, 8, 2, 8).to(torch.bfloat16)
    data = encode_block(kv, key=key(1))
    assert verify_block(data, key=key(1)).key == key(1)
    assert torch.equal(decode_block(data, key=key(1)).payload, kv)
    with pytest.raises(KeyMismatchError, match=key(1).hex()) as e:
        decode_block(data, key=key(2))
    assert isinstance(e.value, CorruptBlockError) and e.value.reason == "key_mismatch"
    with pytest.raises(KeyMismatchError):
        verify_block(data, key=key(2))
    with pytest.raises(KeyMismatchError):
        decode_block(data, key=key(2), verify=False)  # the key is checked even unverified
    # the key is covered by the checksum: rewriting it by hand is caught as corruption
    forged = bytearray(data)
    forged[52:68] = key(2)
    with pytest.raises(CorruptBlockError):
        verify_block(bytes(forged), key=key(2))


def test_an_old_format_block_is_a_clear_error_not_a_crash() -> None:
    old = v1_block(torch.randn(2, 2, 8, 2, 8).to(torch.bfloat16))
    with pytest.raises(
        UnsupportedVersionError, match=r"version 1 .* before blocks carried their key"
    ):
        decode_block(old)
    with pytest.raises(UnsupportedVersionError):
        verify_block(old[:10])  # even cut short, the version is what is reported


@pytest.mark.parametrize("upper_has_it", [False, True])
def test_a_block_re_put_under_another_key_is_rejected_counted_and_deleted(
    upper_has_it: bool,
) -> None:
    # ``lower`` does not verify its reads (like Aerospike or the server): the store checks all
    lower = FlakyTier("remote")
    lower.data[key(2)] = block(1)  # block 1's KV, stored under key 2
    lower.data[key(1)] = block(1)
    with TieredStore([CpuTier(BLOCK_LEN * 10), lower]) as s:
        if upper_has_it:  # the fast, self-verifying tier is checked as well
            s.tiers[0].put([(key(2), block(1))])
        assert s.get([key(1), key(2)]) == [block(1), None]
        where = "cpu" if upper_has_it else "remote"
        assert reasons(s.metrics, where, "key_mismatch") == 1
        assert s.metrics.value("kvtier_corrupt_blocks_total", {"tier": where}) == 1
        assert s.tiers[0].contains([key(2)]) == [False]
        if not upper_has_it:
            assert key(2) not in lower.data and key(1) in lower.data
        s.check_integrity()


def test_a_rejected_block_leaves_the_tiers_below_their_chance() -> None:
    lower = FlakyTier("remote")
    lower.data[key(2)] = block(2)  # the right block, one tier down
    with TieredStore([CpuTier(BLOCK_LEN * 10), lower]) as s:
        s.tiers[0].put([(key(2), block(1))])
        assert s.get([key(2)]) == [block(2)]
        assert reasons(s.metrics, "cpu", "key_mismatch") == 1


def test_old_format_blocks_in_a_tier_are_counted_misses() -> None:
    lower = FlakyTier("remote")
    lower.data[key(1)] = v1_block(torch.randn(2, 2, 8, 2, 8).to(torch.bfloat16))
    with TieredStore([CpuTier(BLOCK_LEN * 10), lower]) as s:
        assert s.get([key(1)]) == [None]
        assert reasons(s.metrics, "remote", "version") == 1
        assert key(1) not in lower.data


def test_a_block_file_moved_to_another_key_is_rejected_counted_and_deleted(
    tmp_path: Path,
) -> None:
    root = tmp_path / "disk"
    with TieredStore([DiskTier(root, BLOCK_LEN * 100)]) as s:
        s.put([(key(1), block(1)), (key(2), block(2))])
        assert s.flush(10)
    (src,) = root.rglob(key(1).hex() + "*")
    (dst,) = root.rglob(key(2).hex() + "*")
    os.replace(src, dst)  # block 1 now sits where key 2's block was
    with TieredStore([DiskTier(root, BLOCK_LEN * 100)]) as s:
        assert s.contains([key(1), key(2)]) == [False, True]
        assert s.get([key(2)]) == [None]
        assert reasons(s.metrics, "disk", "key_mismatch") == 1
        assert s.contains([key(2)]) == [False]
        assert not dst.exists()
        s.check_integrity()


def test_check_key_compares_the_header_key() -> None:
    data = block(3)
    header = verify_block(data)
    check_key(header, key(3))
    with pytest.raises(KeyMismatchError):
        check_key(header, key(4))
    assert len(data) == HEADER_SIZE + header.payload_len
