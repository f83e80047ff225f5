"""What the router believes each engine holds: G1 keys per engine, and the shared tier's keys.

Fed by the engines' KV events (``events.py``); asked, per request, how long a
prefix of its prompt each engine holds in G1 and how long a prefix the
shared tier holds (which every engine can load).

Keys are kvtier's content addresses (``kvtier.keys.PrefixKeys``): the key of
a prefix ending at a block boundary is the same whether an engine's G1 block
or a tier object ends there, so one set of keys per request answers both::

    prompt   |----------------|----------------|--------|---  (B = block, C = chunk)
    G1       key(B) key(2B) ... every block boundary, from token 0 until one is missing
    shared   full chunks key(C), key(2C) ... then the longest tail key(c*C + j*B | end)
             (kvtier.connectors.prefix.longest_stored_prefix, as an engine's connector)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtier.keys import CacheNamespace, PrefixKeys
from kvtier.prefix import longest_stored_prefix


@dataclass(frozen=True)
class PromptKeys:
    """A prompt's keys in one namespace.

    Attributes:
        num_tokens: Prompt length.
        page_tokens: Distance between two G1 boundaries (the engines' block size).
        boundary_keys: Key of the prefix ending at each block boundary, in order.
        keys: The prompt's ``PrefixKeys`` (for the shared-tier lookup).
    """

    num_tokens: int
    page_tokens: int
    boundary_keys: list[bytes]
    keys: PrefixKeys


def prompt_keys(
    token_ids: Sequence[int], namespace: CacheNamespace, page_tokens: int
) -> PromptKeys:
    """Every block-boundary key of a prompt (O(prompt): one hash pass per chunk)."""
    keys = PrefixKeys(namespace, page_tokens)
    keys.extend(token_ids)
    # NOTE: G1 never holds the block with a prompt's last token (at least one is
    # computed), so boundaries stop before the end, as the engine's own lookup.
    limit = max(0, len(token_ids) - 1)
    boundary = [bytes(k) for k in keys.keys_at(keys.boundaries(limit))]
    return PromptKeys(len(token_ids), page_tokens, boundary, keys)


class PrefixIndex:
    """G1 key sets per engine, and a bounded LRU of keys saved to the shared tier.

    Not thread-safe: used on the router's event loop.

    Args:
        max_saved_keys: Shared-tier keys remembered; the oldest are forgotten
            (beyond those the tier's own events remove, ``tier_events.py``).
    """

    def __init__(self, max_saved_keys: int = 1_000_000) -> None:
        self._g1: dict[str, set[bytes]] = {}
        self._saved: OrderedDict[bytes, None] = OrderedDict()
        self._max_saved = max_saved_keys

    def g1_size(self, engine: str) -> int:
        """Keys believed in ``engine``'s G1."""
        return len(self._g1.get(engine, ()))

    @property
    def saved_size(self) -> int:
        """Shared-tier keys remembered."""
        return len(self._saved)

    def reset(self, engine: str, stored: Iterable[bytes], saved: Iterable[bytes]) -> None:
        """Replaces what ``engine`` holds (a snapshot); its saved keys join the shared set."""
        self._g1[engine] = set(stored)
        self.add_saved(saved)

    def forget(self, engine: str) -> None:
        """``engine`` is gone: its G1 is unknown."""
        self._g1.pop(engine, None)

    def stored(self, engine: str, keys: Iterable[bytes]) -> None:
        self._g1.setdefault(engine, set()).update(keys)

    def evicted(self, engine: str, keys: Iterable[bytes]) -> None:
        self._g1.get(engine, set()).difference_update(keys)

    def add_saved(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            self._saved[k] = None
            self._saved.move_to_end(k)
        while len(self._saved) > self._max_saved:
            self._saved.popitem(last=False)

    def remove_saved(self, keys: Iterable[bytes]) -> None:
        """The shared tier no longer holds ``keys`` (its own eviction events)."""
        for k in keys:
            self._saved.pop(k, None)

    def replace_saved(self, keys: Iterable[bytes]) -> None:
        """The shared tier holds exactly ``keys`` (a snapshot of its events)."""
        self._saved.clear()
        self.add_saved(keys)

    def g1_tokens(self, engine: str, pk: PromptKeys) -> int:
        """Leading prompt tokens ``engine`` holds in G1 (whole blocks from token 0)."""
        held = self._g1.get(engine)
        if not held:
            return 0
        n = 0
        for key in pk.boundary_keys:
            if key not in held:
                break
            n += 1
        return n * pk.page_tokens

    def shared_tokens(self, pk: PromptKeys) -> int:
        """Leading prompt tokens the shared tier holds (as an engine's connector finds them)."""
        if not self._saved:
            return 0
        ends = pk.keys.lookup_ends(pk.num_tokens)
        present = [bytes(k) in self._saved for k in pk.keys.keys_at(ends)]
        return longest_stored_prefix(pk.keys, pk.num_tokens, present).num_tokens
