"""vLLM's block hashes mapped to the router's keys: one engine's G1 as its KV events show it.

vLLM names a cached block by its own chained hash (``hash(parent hash, the
block's token ids, extra keys)``, SHA-256 by default); the router names a
prefix by kvtier's key (``kvtier.keys.PrefixKeys``). The two cannot be
converted into each other, but a ``BlockStored`` event carries what the
router needs to compute its own key: the parent block's hash and the
block's token ids. So the map keeps, per vLLM hash it was told of, the
router key of the prefix that block ends and the running hash to extend it::

    BlockStored(parent=P, hashes=[h1, h2], token_ids=t[0:2B], block_size=B)
        node(P) = (key K_P, end e, running hash R_P)      None parent: e = 0, the root
        h1 -> key of t up to e+B  = R_P ‖ t[0:B]           (R restarts from K at a chunk start)
        h2 -> key of t up to e+2B = R_h1 ‖ t[B:2B]
    BlockRemoved([h1])  -> h1's key leaves G1 (when no other copy holds the hash)
    AllBlocksCleared    -> G1 is empty

The keys equal ``PrefixKeys(namespace, B).key(end)``, the keys the router
computes from a prompt (tested), so a prompt's prefix is matched against
vLLM's G1 as against the bundled engine's. Blocks the router cannot name are
skipped, and with them every block chained after them: a parent it was never
told of (it joined late or lost events), blocks of a LoRA adapter or with
extra keys (a cache salt, multimodal inputs: the same tokens are another
prefix there), blocks of another medium (a connector's CPU offload) or
another KV group, partial blocks. Skipping only makes the router believe
less than vLLM holds: a request is then computed, never wrong.

Bounded: at most ``max_blocks`` nodes per engine (vLLM's block count is
bounded too; past it the map is cleared, as after a gap).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.keys import KEY_BYTES, CacheNamespace

G1_MEDIA = (None, "GPU")  # vLLM's own KV cache ("GPU" even on the CPU backend)
_INT32_MAX = 2**31 - 1

VllmHash = (
    bytes | int
)  # ExternalBlockHash: SHA-256 bytes, or 64-bit ints (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)


def local_namespace(block_size: int) -> CacheNamespace:
    """The namespace the router names a vLLM engine's G1 in when it is given none.

    Only the router computes these keys (from prompts and from events), so
    any fixed namespace works for G1; it shares no key with a tier.
    """
    return CacheNamespace("vllm-g1", "", 1, 1, 1, "unknown", chunk_size=block_size)


class _Node:
    """What the router knows of one vLLM block hash."""

    __slots__ = ("copies", "end", "key", "running")

    def __init__(self, key: bytes, end: int, running: Any) -> None:
        self.key = key  # router key of the prefix the block ends
        self.end = end  # tokens in that prefix
        self.running = running  # hash state to extend within the chunk; None at a chunk end
        self.copies = 1  # BlockStored minus BlockRemoved of this hash


@dataclass
class MapChanges:
    """The net effect of a batch of events on the router's view of the engine's G1.

    Attributes:
        stored: Keys held after the batch that were not before (in order).
        evicted: Keys held before the batch that are not after.
        cleared: Every key held before the batch was dropped (then ``stored`` is all).
        skipped_blocks: Blocks the router cannot name (see the module docstring).
    """

    stored: dict[bytes, None] = field(default_factory=dict)
    evicted: dict[bytes, None] = field(default_factory=dict)
    cleared: bool = False
    skipped_blocks: int = 0

    def store(self, key: bytes) -> None:
        self.evicted.pop(key, None)
        self.stored[key] = None

    def evict(self, key: bytes) -> None:
        self.stored.pop(key, None)
        self.evicted[key] = None

    def clear(self) -> None:
        self.stored.clear()
        self.evicted.clear()
        self.cleared = True


class VllmEventError(ValueError):
    """A KV event or batch that is not what vLLM publishes (names what is wrong)."""


class VllmBlockMap:
    """One vLLM engine's cached blocks, by vLLM hash, with the router key of each.

    Not thread-safe (the router's event loop).

    Args:
        namespace: The namespace of the router's keys for this engine (the
            engine's kvtier connector's, so the same keys name its tier
            objects); None: ``local_namespace`` of the engine's block size.
        max_blocks: Nodes kept; past it everything is forgotten (``cleared``).
    """

    def __init__(self, namespace: CacheNamespace | None = None, max_blocks: int = 1 << 20) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be positive")
        self._given = namespace
        self.namespace: CacheNamespace | None = None
        self.block_size: int | None = None
        self.max_blocks = max_blocks
        self._nodes: dict[VllmHash, _Node] = {}
        self._root: bytes = b""

    def __len__(self) -> int:
        return len(self._nodes)

    def key_of(self, block_hash: VllmHash) -> bytes | None:
        """The router key of a vLLM block hash (None: not known)."""
        node = self._nodes.get(block_hash)
        return node.key if node is not None else None

    def clear(self) -> list[bytes]:
        """Forgets every block; returns the keys that were held."""
        keys = [n.key for n in self._nodes.values()]
        self._nodes.clear()
        return keys

    # ---- events ---------------------------------------------------------------------------

    def apply(self, events: Iterable[Mapping[str, Any]]) -> MapChanges:
        """Applies one batch's events (decoded maps with a ``type``), in order.

        Raises:
            VllmEventError: for an event that is not vLLM's (the caller then
                treats the batch as lost: a gap). Events before it are applied.
        """
        out = MapChanges()
        for ev in events:
            if not isinstance(ev, Mapping):
                raise VllmEventError(f"a KV event must be a map, got {type(ev).__name__}")
            kind = ev.get("type")
            if kind == "BlockStored":
                self._stored(ev, out)
            elif kind == "BlockRemoved":
                self._removed(ev, out)
            elif kind == "AllBlocksCleared":
                self.clear()
                out.clear()
            else:
                raise VllmEventError(f"unknown KV event type {kind!r}")
        return out

    def _setup(self, block_size: int) -> bool:
        """Fixes the block size at the first full block; False if it does not fit the namespace."""
        if self.block_size is None:
            ns = self._given or local_namespace(block_size)
            if ns.chunk_size % block_size:
                raise VllmEventError(
                    f"vLLM's block size {block_size} does not divide the namespace's chunk "
                    f"size {ns.chunk_size}: give vLLM --block-size dividing it"
                )
            self.namespace, self.block_size = ns, block_size
            self._root = ns.root_key()
        return block_size == self.block_size

    def _stored(self, ev: Mapping[str, Any], out: MapChanges) -> None:
        hashes = _hashes(ev, "block_hashes")
        tokens = ev.get("token_ids")
        size = ev.get("block_size")
        if not isinstance(tokens, list) or not isinstance(size, int) or size <= 0:
            raise VllmEventError("BlockStored needs token_ids (a list) and a positive block_size")
        if len(tokens) != len(hashes) * size:
            raise VllmEventError(
                f"BlockStored has {len(tokens)} token ids for {len(hashes)} blocks of {size}"
            )
        if (
            ev.get("medium") not in G1_MEDIA
            or ev.get("group_idx") not in (None, 0)
            or ev.get("lora_id") is not None
            or ev.get("lora_name") is not None
            or any(k for k in (ev.get("extra_keys") or ()))
            or not self._setup(size)  # a partial block (hybrid models)
        ):
            out.skipped_blocks += len(hashes)
            return
        assert self.namespace is not None
        parent = ev.get("parent_block_hash")
        if parent is None:
            end, key, running = 0, self._root, None
        else:
            node = self._nodes.get(_hash(parent))
            if node is None:  # chained after a block the router was not told of
                out.skipped_blocks += len(hashes)
                return
            end, key, running = node.end, node.key, node.running
        chunk = self.namespace.chunk_size
        for i, h in enumerate(hashes):
            have = self._nodes.get(h)
            if have is not None:  # another copy of a cached prefix
                have.copies += 1
                end, key, running = have.end, have.key, have.running
                continue
            # NOTE: the chain of kvtier.keys.PrefixKeys: one running hash per chunk,
            # seeded with the previous chunk's key, copied at each block boundary.
            if end % chunk == 0:
                h_run = self.namespace.chain(key)
            else:
                assert running is not None  # a node off a chunk end keeps its running hash
                h_run = running.copy()
            h_run.update(_token_bytes(tokens[i * size : (i + 1) * size]))
            end += size
            key = h_run.digest()[:KEY_BYTES]
            running = None if end % chunk == 0 else h_run
            self._nodes[h] = _Node(key, end, running)
            out.store(key)
        if len(self._nodes) > self.max_blocks:
            self.clear()
            out.clear()

    def _removed(self, ev: Mapping[str, Any], out: MapChanges) -> None:
        hashes = _hashes(ev, "block_hashes")
        if ev.get("medium") not in G1_MEDIA or ev.get("group_idx") not in (None, 0):
            return
        for h in hashes:
            node = self._nodes.get(h)
            if node is None:
                continue
            node.copies -= 1
            if node.copies <= 0:
                del self._nodes[h]
                out.evict(node.key)


def _hash(value: Any) -> VllmHash:
    if isinstance(value, bytes | int) and not isinstance(value, bool):
        return value
    raise VllmEventError(f"a block hash must be bytes or an int, got {type(value).__name__}")


def _hashes(ev: Mapping[str, Any], name: str) -> list[VllmHash]:
    value = ev.get(name)
    if not isinstance(value, list):
        raise VllmEventError(f"{ev.get('type')} needs {name} (a list)")
    return [_hash(v) for v in value]


def _token_bytes(tokens: Sequence[Any]) -> bytes:
    """int32-LE bytes of token ids, as ``kvtier.keys`` hashes them."""
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise VllmEventError("token ids must be integers")
    if any(t < 0 or t > _INT32_MAX for t in tokens):
        raise VllmEventError("token ids must lie in [0, 2**31 - 1]")
    return np.asarray(tokens, dtype="<i4").tobytes()
