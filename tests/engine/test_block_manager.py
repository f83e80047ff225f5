"""Block manager: reference counts, prefix hits over full blocks, LRU reuse of freed blocks."""

from __future__ import annotations

import pytest

from kvtier.engine.block_manager import BlockManager
from kvtier.keys import CacheNamespace, PrefixKeys
from tests.engine.fakes import make_request

BS = 4


def _computed(bm: BlockManager, req, n: int) -> None:
    """Marks the first ``n`` tokens of ``req`` as computed and registers full blocks."""
    req.num_computed_tokens = n
    bm.cache_blocks(req)


def test_allocate_and_free_keep_refcounts_exact() -> None:
    bm = BlockManager(10, BS)
    a = make_request("a", list(range(10)))  # 3 blocks
    assert bm.can_allocate([], 10)
    bm.allocate(a, [], 10)
    assert len(a.block_ids) == 3 and bm.num_free_blocks == 7
    assert bm.can_append(a, 12) and not bm.can_append(a, 4 * 10 + 1)
    bm.append(a, 13)  # 4 blocks
    assert len(a.block_ids) == 4 and bm.num_used_blocks == 4
    bm.check_integrity([a])
    bm.free(a)
    assert a.block_ids == [] and bm.num_free_blocks == 10
    bm.check_integrity([])
    with pytest.raises(RuntimeError):
        bm.allocate(make_request("big", list(range(41))), [], 41)


def test_prefix_hit_shares_blocks_and_never_covers_the_last_token() -> None:
    bm = BlockManager(16, BS)
    a = make_request("a", list(range(11)))
    bm.allocate(a, [], 11)
    _computed(bm, a, 11)  # blocks 0,1 full -> registered; block 2 partial
    b = make_request("b", [*range(8), 99, 98])
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_ids[:2]
    bm.allocate(b, hits, 10)
    assert b.block_ids[:2] == a.block_ids[:2]
    assert bm.blocks[a.block_ids[0]].ref_count == 2
    bm.check_integrity([a, b])
    # a prompt equal to a cached prefix: its last token must still be computed
    c = make_request("c", list(range(8)))
    assert len(bm.find_cached_prefix(c)) == 1
    # a different first block breaks the chain even if later blocks match
    d = make_request("d", [50, 1, 2, 3, 4, 5, 6, 7, 8])
    assert bm.find_cached_prefix(d) == []
    bm.free(a)
    bm.free(b)
    bm.check_integrity([])


def test_freed_blocks_stay_cached_until_reused_lru() -> None:
    bm = BlockManager(6, BS)
    a = make_request("a", list(range(9)))  # blocks 0, 1 (full), 2 (partial)
    bm.allocate(a, [], 9)
    assert a.block_ids == [0, 1, 2]
    _computed(bm, a, 9)
    bm.free(a)  # tail first: free list is now 3, 4, 5, 2, 1, 0
    assert bm.num_free_blocks == 6 and bm.num_cached_free_blocks == 2
    probe = make_request("probe", list(range(9)))
    assert bm.find_cached_prefix(probe) == [0, 1]
    # reviving the two cached blocks leaves 4 others: 2 + 4 blocks fit, 2 + 5 do not
    assert bm.can_allocate([0, 1], 4 * 6) and not bm.can_allocate([0, 1], 4 * 7)
    x = make_request("x", [100 + i for i in range(16)])
    bm.allocate(x, [], 16)  # takes 3, 4, 5 (never used) and 2 (a's tail, not cached)
    assert sorted(x.block_ids) == [2, 3, 4, 5]
    assert bm.find_cached_prefix(probe) == [0, 1]
    y = make_request("y", [200, 201, 202, 203])
    bm.allocate(y, [], 4)  # the least recently freed cached block: a's second block
    assert y.block_ids == [1]
    assert bm.find_cached_prefix(probe) == [0]
    bm.free(x)
    bm.check_integrity([y])
    # a revived block leaves the free list and is shared again
    b = make_request("b", list(range(9)))
    bm.allocate(b, bm.find_cached_prefix(b), 9)
    assert b.block_ids[0] == 0 and bm.blocks[0].ref_count == 1
    bm.check_integrity([y, b])


def test_prefix_caching_disabled_never_hits() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    bm.allocate(a, [], 9)
    _computed(bm, a, 9)
    assert bm.find_cached_prefix(make_request("b", list(range(9)))) == []
    assert bm.num_cached_free_blocks == 0


def test_duplicate_content_registers_once_and_frees_cleanly() -> None:
    bm = BlockManager(8, BS)
    a, b = make_request("a", list(range(9))), make_request("b", list(range(9)))
    bm.allocate(a, [], 9)
    bm.allocate(b, [], 9)  # admitted together: neither was cached yet
    _computed(bm, a, 9)
    _computed(bm, b, 9)
    hits = bm.find_cached_prefix(make_request("c", list(range(9))))
    assert hits == a.block_ids[:2]
    bm.free(a)
    bm.free(b)
    bm.check_integrity([])


def test_blocks_are_keyed_by_the_requests_own_prefix_keys() -> None:
    """One hash per request: G1 keys a block by the key of the prefix it ends, from the keys
    the request carries (which the connector and the KV events read too)."""
    ns = CacheNamespace("m", "fp", 2, 2, 8, "float32", chunk_size=8)
    bm = BlockManager(8, BS, namespace=ns)
    req = make_request("a", list(range(1, 12)))
    bm.allocate(req, bm.find_cached_prefix(req), req.num_tokens)
    keys = req.prefix_keys
    assert keys is not None and keys.namespace == ns and keys.num_tokens == 11
    _computed(bm, req, 11)
    assert req.prefix_keys is keys  # hashed once, kept on the request
    expected = PrefixKeys(ns, BS)
    expected.extend(req.token_ids)
    assert [bm.blocks[b].hash for b in req.block_ids[:2]] == [expected.key(4), expected.key(8)]
    other = BlockManager(8, BS, namespace=ns.with_tenant("t"))  # another namespace, other keys
    twin = make_request("b", list(range(1, 12)))
    other.allocate(twin, [], 11)
    _computed(other, twin, 11)
    assert other.blocks[twin.block_ids[0]].hash != expected.key(4)


def keys_tokens(keys: PrefixKeys, i: int) -> list[int]:
    """The tokens of block ``i`` (of 4) alone: a "hash" that ignores the prefix."""
    return [
        int.from_bytes(keys._data[4 * t : 4 * t + 4], "little") for t in range(4 * i, 4 * i + 4)
    ]


def test_a_colliding_hash_is_a_miss_not_another_prompts_kv(monkeypatch) -> None:
    """With a hash that ignores the prefix, a block cached under another prefix is not served."""
    import kvtier.engine.block_manager as block_manager

    monkeypatch.setattr(
        block_manager.BlockManager,
        "_block_key",
        lambda self, keys, i: bytes(str(keys_tokens(keys, i)), "ascii"),
    )
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    d = make_request("d", [9, 9, 9, 9, 7, 7, 7, 7, 0])
    for r in (a, d):
        bm.allocate(r, [], 9)
        _computed(bm, r, 9)
    # a's first block, then d's second: the weak hash of block 1 collides with d's
    mixed = make_request("m", [1, 2, 3, 4, 7, 7, 7, 7, 0])
    assert bm.find_cached_prefix(mixed) == a.block_ids[:1]
    assert bm.find_cached_prefix(make_request("a2", [1, 2, 3, 4, 5, 6, 7, 8, 1])) == a.block_ids[:2]
    for r in (a, d):
        bm.free(r)
    bm.check_integrity([])
