"""KV block allocation with reference counts and a prefix cache over full blocks (G1).

A block is identified by the key of the prefix it ends: the request's own
keys (``Request.prefix_keys``, :class:`kvtier.keys.PrefixKeys` in the
engine's namespace), computed once per request and read alike by this cache,
the KV connector and the KV events (``kv_events.py``), as vLLM's
``request.block_hashes`` are::

    key(block i) = keys.key((i + 1) * block_size)     a chained SHA-256 over the prefix

so equal keys mean equal prefixes. A match is also checked against what
the cache recorded: the block's own tokens, and that its parent is the block
matched just before it, so even a key collision is a miss, never another
prompt's KV. The hash is cryptographic because prompts are chosen by
clients: with a 64-bit non-cryptographic hash a client could craft a prompt
whose blocks collide with another tenant's (vLLM moved to SHA-256 for this,
CVE-2025-25183). Only full, computed blocks are registered. A freed block
keeps its key and contents in an LRU free list and can be revived by a later
request until it is handed out again.

    free list (LRU order):  [oldest freed ... most recently freed]
    allocate()  takes from the left (evicting that block's key, if any)
    free()      appends to the right (a request's tail blocks first, so its
                prefix stays cached longest)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from kvtier.engine.request import Request
from kvtier.keys import CacheNamespace, PrefixKeys


class BlockListener(Protocol):
    """Told when the prefix cache gains or loses a block (``kv_events.KvEventRecorder``)."""

    def stored(self, key: bytes, block_id: int) -> None: ...

    def evicted(self, block_id: int) -> None: ...


@dataclass
class Block:
    """One KV block's bookkeeping."""

    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    tokens: tuple[int, ...] | None = None
    parent: int | None = None  # the registered block before it when it was registered


class BlockManager:
    """Hands out KV blocks to requests; finds cached prefixes.

    Not thread-safe: used only from the engine's step thread.

    Args:
        num_blocks: Blocks in the KV cache.
        block_size: Tokens per block; must divide the namespace's chunk size.
        enable_prefix_caching: Register and look up full blocks.
        namespace: Where requests' keys are computed (``connector.keys_namespace``;
            default: one of the block size alone, for tests of the cache alone).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        namespace: CacheNamespace | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.namespace = namespace or CacheNamespace(
            "kvtier-engine", "", 1, 1, 1, "float32", chunk_size=block_size
        )
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[bytes, int] = {}
        self._num_cached_free = 0  # free blocks that still hold a registered prefix
        self.prefix_cache_queries_tokens = 0
        self.prefix_cache_hit_tokens = 0
        self.listener: BlockListener | None = None  # KV events (engine/kv_events.py)

    # ---- queries -----------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (cached or not)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a registered prefix."""
        return self._num_cached_free

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def keys_of(self, request: Request, num_tokens: int | None = None) -> PrefixKeys:
        """The request's keys, made on first sight (its arrival) and grown over its tokens."""
        keys = request.prefix_keys
        if keys is None:
            keys = request.prefix_keys = PrefixKeys(self.namespace, self.block_size)
        n = request.num_tokens if num_tokens is None else num_tokens
        if keys.num_tokens < n:
            keys.extend(request.token_ids[keys.num_tokens : n])
        return keys

    def _block_key(self, keys: PrefixKeys, index: int) -> bytes:
        """The key of block ``index``: the key of the prefix it ends."""
        return keys.key((index + 1) * self.block_size)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Leading blocks of ``request`` already in the cache (a miss is ``[]``).

        At most ``(num_tokens - 1) // block_size`` blocks are matched so at
        least one token is left to compute. Pure: takes no references.
        """
        if not self.enable_prefix_caching:
            self.keys_of(request)
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        keys = self.keys_of(request)
        bs = self.block_size
        hit: list[int] = []
        for i in range(max_blocks):
            block_id = self._hash_to_block.get(self._block_key(keys, i))
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.parent != (hit[-1] if hit else None) or block.tokens != tuple(
                request.token_ids[i * bs : (i + 1) * bs]
            ):
                break  # hash collision: treat as a miss
            hit.append(block_id)
        return hit

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Counts one prefix-cache lookup of an admitted request (in tokens)."""
        self.prefix_cache_queries_tokens += num_query_tokens
        self.prefix_cache_hit_tokens += num_hit_tokens

    # ---- allocation ----------------------------------------------------------

    def can_allocate(self, cached_blocks: list[int], num_tokens: int) -> bool:
        """Whether a request can get blocks for ``num_tokens`` tokens, reusing ``cached_blocks``."""
        new = self.blocks_needed(num_tokens) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        return self.num_free_blocks - revived >= max(new, 0)

    def allocate(self, request: Request, cached_blocks: list[int], num_tokens: int) -> None:
        """Gives ``request`` (which holds no blocks) ``cached_blocks`` plus new blocks
        up to ``num_tokens`` tokens.

        Raises:
            RuntimeError: if the request already holds blocks or there is no room
                (callers check ``can_allocate`` first).
        """
        if request.block_ids:
            raise RuntimeError(f"request {request.request_id} already holds blocks")
        if not self.can_allocate(cached_blocks, num_tokens):
            raise RuntimeError("allocate() without room; call can_allocate() first")
        for b in cached_blocks:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self._free[b]
                self._num_cached_free -= block.hash is not None
            block.ref_count += 1
            request.block_ids.append(b)
        request.num_cached_blocks = len(cached_blocks)
        for _ in range(self.blocks_needed(num_tokens) - len(cached_blocks)):
            request.block_ids.append(self._take_free())

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            self._num_cached_free -= 1
            if self._hash_to_block.get(block.hash) == block_id:
                del self._hash_to_block[block.hash]
                if self.listener is not None:
                    self.listener.evicted(block_id)
            block.hash = None
            block.tokens = None
            block.parent = None
        block.ref_count = 1
        return block_id

    def can_append(self, request: Request, num_tokens: int) -> bool:
        """Whether ``request`` can grow to hold ``num_tokens`` tokens."""
        return self.blocks_needed(num_tokens) - len(request.block_ids) <= self.num_free_blocks

    def append(self, request: Request, num_tokens: int) -> None:
        """Grows ``request``'s block table to hold ``num_tokens`` tokens.

        Raises:
            RuntimeError: if there is no room (callers check ``can_append`` first).
        """
        if not self.can_append(request, num_tokens):
            raise RuntimeError("append() without room; call can_append() first")
        for _ in range(self.blocks_needed(num_tokens) - len(request.block_ids)):
            request.block_ids.append(self._take_free())

    def free(self, request: Request) -> None:
        """Drops ``request``'s references; blocks reaching zero join the LRU free list."""
        for b in reversed(request.block_ids):
            block = self.blocks[b]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {b} freed more often than allocated")
            if block.ref_count == 0:
                self._free[b] = None
                self._num_cached_free += block.hash is not None
        request.block_ids = []
        request.num_cached_blocks = 0

    def cache_blocks(self, request: Request) -> None:
        """Registers ``request``'s newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if full <= request.num_cached_blocks:
            return
        bs = self.block_size
        keys = self.keys_of(request, full * bs)
        for i in range(request.num_cached_blocks, full):
            block = self.blocks[request.block_ids[i]]
            h = self._block_key(keys, i)
            if block.hash is None and h not in self._hash_to_block:
                block.hash = h
                block.tokens = tuple(request.token_ids[i * bs : (i + 1) * bs])
                block.parent = self._hash_to_block.get(self._block_key(keys, i - 1)) if i else None
                self._hash_to_block[h] = block.block_id
                if self.listener is not None:
                    self.listener.stored(h, block.block_id)
        request.num_cached_blocks = full

    def check_integrity(self, requests: list[Request]) -> None:
        """Asserts that reference counts equal the block tables of ``requests``.

        Raises:
            AssertionError: on any inconsistency (for tests).
        """
        counts = [0] * self.num_blocks
        for r in requests:
            for b in r.block_ids:
                counts[b] += 1
        for block in self.blocks:
            assert block.ref_count == counts[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} != {counts[block.block_id]}"
            )
            assert (block.ref_count == 0) == (block.block_id in self._free), (
                f"block {block.block_id}: free-list membership disagrees with ref_count"
            )
        for h, b in self._hash_to_block.items():
            assert self.blocks[b].hash == h, f"hash table points at block {b} with another hash"
        cached_free = sum(1 for b in self._free if self.blocks[b].hash is not None)
        assert cached_free == self._num_cached_free, (
            f"{cached_free} cached free blocks, counted {self._num_cached_free}"
        )
