"""Block-granular keys, the longest stored prefix, and the save plan."""

from __future__ import annotations

import random

import pytest

from kvtier.connectors.request_state import RequestState
from kvtier.errors import ConfigError
from kvtier.keys import CacheNamespace, PrefixKeys, chunk_keys
from kvtier.prefix import longest_stored_prefix

NS = CacheNamespace("m", "fp", 2, 2, 4, "bfloat16", chunk_size=64)


def _keys(tokens: list[int], block: int = 16) -> PrefixKeys:
    k = PrefixKeys(NS, block)
    k.extend(tokens)
    return k


def test_full_chunk_keys_are_chunk_keys_and_grow_the_same_however_extended() -> None:
    toks = list(range(1000, 1300))
    whole = _keys(toks)
    grown = PrefixKeys(NS, 16)
    for a, b in ((0, 7), (7, 100), (100, 250), (250, 300)):
        grown.extend(toks[a:b])
        grown.keys_at(grown.boundaries(grown.num_tokens))  # hash as we go
    assert grown.keys_at(grown.boundaries(300)) == whole.keys_at(whole.boundaries(300))
    assert [whole.key(64 * (i + 1)) for i in range(4)] == chunk_keys(toks, NS)
    # a partial chunk's key is the old partial-chunk key when it is block-aligned
    assert whole.key(96) == chunk_keys(toks[:96], NS, include_partial=True)[-1]


def test_keys_do_not_depend_on_block_size_and_differ_per_boundary() -> None:
    toks = list(range(500, 700))
    k16, k32 = _keys(toks, 16), _keys(toks, 32)
    assert k16.key(32) == k32.key(32) and k16.key(128) == k32.key(128)
    keys = k16.keys_at(k16.lookup_ends(200))
    assert k16.lookup_ends(200)[-2:] == [192, 200]  # the blocks, then the exact end
    assert len(keys) == 13 and len(set(keys)) == 13
    changed = [*toks[:70], toks[70] + 1, *toks[71:]]
    kc = _keys(changed).keys_at(k16.lookup_ends(200))
    assert keys[:4] == kc[:4] and all(a != b for a, b in zip(keys[4:], kc[4:], strict=True))


def test_bad_lengths_and_block_sizes_are_refused() -> None:
    k = _keys(list(range(100)))
    for bad in (0, -16, 112):
        with pytest.raises(ValueError):
            k.key(bad)
    # an end off a block boundary is the same formula: the old partial-chunk key
    assert k.key(70) == chunk_keys(list(range(70)), NS, include_partial=True)[-1]
    with pytest.raises(ConfigError):
        PrefixKeys(NS, 24)


def _present(keys: PrefixKeys, limit: int, stored: set[int]) -> list[bool]:
    return [e in stored for e in keys.lookup_ends(limit)]


def test_longest_prefix_walks_full_chunks_then_the_longest_tail() -> None:
    k = _keys(list(range(300)))
    # chunks 0 and 1 stored, tails at 144 and 160 in chunk 2, and a stray object past a hole
    stored = {64, 128, 144, 160, 256}
    p = longest_stored_prefix(k, 300, _present(k, 300, stored))
    assert p.num_tokens == 160
    assert [(o.start, o.end) for o in p.objects] == [(0, 64), (64, 128), (128, 160)]
    assert [o.key for o in p.objects] == [k.key(64), k.key(128), k.key(160)]
    assert [(o.start, o.end) for o in p.objects_from(100)] == [(64, 128), (128, 160)]
    # a tail without its chunks before it is no prefix
    assert longest_stored_prefix(k, 300, _present(k, 300, {80})).num_tokens == 0
    # the limit caps the walk
    assert longest_stored_prefix(k, 150, _present(k, 150, stored)).num_tokens == 144


@pytest.mark.parametrize("exact", [True, False])
def test_random_lengths_stored_whole_are_found_whole(exact: bool) -> None:
    rng = random.Random(3)
    for _ in range(50):
        n = rng.randrange(1, 600)
        toks = [rng.randrange(1000) for _ in range(n)]
        state = RequestState.new(PrefixKeys(NS, 16), 16, toks)
        saved = state.chunks_to_save(toks, n)
        tail = state.tail_to_save(toks, n, exact=exact)
        stored = {o.end for o in saved} | ({tail.end} if tail else set())
        p = longest_stored_prefix(state.keys, n, _present(state.keys, n, stored))
        # the prompt's end, or what G1 would hold: its last full block
        assert p.num_tokens == (n if exact else (n // 16) * 16)
        # a longer prompt extending this one finds the block-aligned part
        longer = RequestState.new(PrefixKeys(NS, 16), 16, [*toks, *range(40)])
        q = longest_stored_prefix(longer.keys, n + 40, _present(longer.keys, n + 40, stored))
        found_tail = n if n % 16 == 0 or not exact else (n // 64) * 64
        assert q.num_tokens == (found_tail if exact else (n // 16) * 16)


def test_save_plan_saves_each_object_once_and_again_after_a_failed_load() -> None:
    toks = list(range(200))
    s = RequestState.new(PrefixKeys(NS, 16), 16, toks[:150])
    assert [(o.start, o.end) for o in s.chunks_to_save(toks, 100)] == [(0, 64)]
    assert s.chunks_to_save(toks, 120) == []
    assert [(o.start, o.end) for o in s.chunks_to_save(toks, 150)] == [(64, 128)]
    tail = s.tail_to_save(toks, 150)
    assert tail is not None and (tail.start, tail.end) == (128, 144)
    assert s.tail_to_save(toks, 150) is None  # saved already
    exact = s.tail_to_save(toks, 150, exact=True)
    assert exact is not None and (exact.start, exact.end) == (128, 150)
    assert exact.key == _keys(toks[:150]).key(150)
    # decode went on past the prompt: keys grow over generated tokens
    assert [(o.start, o.end) for o in s.chunks_to_save(toks, 199)] == [(128, 192)]
    assert s.keys.key(192) == _keys(toks).key(192)
    s.load_failed_at(70)
    assert s.chunks_stored_to == 64 and s.tails_stored == set()
    assert [(o.start, o.end) for o in s.chunks_to_save(toks, 199)] == [(64, 128), (128, 192)]
    # a tail is only saved when the chunks before it are stored
    t = RequestState.new(PrefixKeys(NS, 16), 16, toks[:100])
    assert t.tail_to_save(toks, 100) is None
