"""What the connector knows of one request: its keys, what is stored, what to save next.

Held by the scheduler side (``scheduler_side.py``) for every engine: engines
differ in how their caches are laid out, not in what is stored or loaded.

Save plan, in tokens (C = chunk, P = page)::

    computed:   |================================|....
    objects:    [ chunk 0 ][ chunk 1 ][ tail )
                 saved as soon as      saved when the prompt's prefill ends (to its
                 C tokens are computed exact end) and, with save_decode, when the
                                       request ends (prompt + generated, to the
                                       last full page)

Leading full chunks that the lookup found stored are never saved again;
a chunk whose load failed is saved again once recomputed.

Sampled verification (``connectors/verify.py``): the load stops before the
first sampled object; it and every stored object after it are computed by
the engine and, once computed, compared with their stored blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.keys import PrefixKeys
from kvtier.prefix import ObjectRef, StoredPrefix, object_ref


@dataclass
class RequestState:
    """One request, from its first lookup to its end.

    Attributes:
        keys: Keys of its tokens (grown over generated tokens when they are
            saved; the engine's own when it computed them, else the connector's).
        page_tokens: Granularity of lookups and of saved tails (``page_tokens``).
        num_prompt_tokens: Prompt length.
        chunks_stored_to: Tokens ``[0, chunks_stored_to)`` are stored as full
            chunks (found by the lookup or saved); a multiple of the chunk size.
        tails_stored: Ends of tail objects found or saved.
        prefix: The last lookup's answer, and when it was made.
        sampled: Whether each loadable object's key was sampled for
            verification (drawn once per request).
        verify: Stored objects the engine computes, to compare with their blocks.
    """

    keys: PrefixKeys
    page_tokens: int
    num_prompt_tokens: int
    chunks_stored_to: int = 0
    tails_stored: set[int] = field(default_factory=set)
    prefix: StoredPrefix | None = None
    looked_up_at: float = 0.0
    sampled: dict[bytes, bool] = field(default_factory=dict)
    verify: list[ObjectRef] = field(default_factory=list)

    @staticmethod
    def new(keys: PrefixKeys, page_tokens: int, prompt: Sequence[int]) -> RequestState:
        """A request seen for the first time; ``keys`` are grown over its prompt if need be."""
        if keys.num_tokens < len(prompt):
            keys.extend(prompt[keys.num_tokens :])
        return RequestState(keys, page_tokens, len(prompt))

    def lookup_keys(self) -> tuple[list[int], list[bytes]]:
        """Where a stored prefix of the prompt can end (every page boundary and its end), and
        the keys of those prefixes."""
        ends = self.keys.lookup_ends(self.num_prompt_tokens, self.page_tokens)
        keys: list[bytes] = list(self.keys.keys_at(ends))
        return ends, keys

    @property
    def chunk_size(self) -> int:
        """Tokens per full chunk."""
        return self.keys.namespace.chunk_size

    def lookup_is_fresh(self, max_age_s: float) -> bool:
        """Whether the last lookup may be reused (a request waiting for blocks asks every step)."""
        return self.prefix is not None and time.monotonic() - self.looked_up_at < max_age_s

    def remember_lookup(self, prefix: StoredPrefix) -> None:
        """Records a lookup; its full chunks and tail count as stored."""
        self.prefix = prefix
        self.looked_up_at = time.monotonic()
        for o in prefix.objects:
            if o.num_tokens == self.chunk_size and o.start == self.chunks_stored_to:
                self.chunks_stored_to = o.end
            elif o.num_tokens < self.chunk_size:
                self.tails_stored.add(o.end)

    def load_failed_at(self, token: int) -> None:
        """A load stopped at ``token``: what follows is recomputed, so it is saved again."""
        c = self.chunk_size
        self.chunks_stored_to = min(self.chunks_stored_to, (token // c) * c)
        self.tails_stored = {e for e in self.tails_stored if e <= token}

    def plan_verification(self, computed: int, end: int, sample: Callable[[bytes], bool]) -> int:
        """Where a load of tokens ``[computed, end)`` stops so that sampled objects are computed.

        Objects starting in ``[computed, end)`` are sampled (once per request);
        the load stops at the first sampled one, which with every stored
        object after it becomes ``verify``. Returns ``end`` when none is sampled.
        """
        assert self.prefix is not None
        self.verify = []
        for o in self.prefix.objects:
            if not computed <= o.start < end:
                continue
            if o.key not in self.sampled:
                self.sampled[o.key] = sample(o.key)
            if self.sampled[o.key]:
                self.verify = [p for p in self.prefix.objects if p.start >= o.start]
                return o.start
        return end

    def verifiable(self, computed: int) -> list[ObjectRef]:
        """Objects of ``verify`` whose tokens are all within the first ``computed`` (taken off it)."""
        ready = [o for o in self.verify if o.end <= computed]
        if ready:
            self.verify = [o for o in self.verify if o.end > computed]
        return ready

    def _grow_keys(self, token_ids: Sequence[int], num_tokens: int) -> None:
        if num_tokens > self.keys.num_tokens:
            self.keys.extend(token_ids[self.keys.num_tokens : num_tokens])

    def chunks_to_save(self, token_ids: Sequence[int], computed: int) -> list[ObjectRef]:
        """Full chunks within the first ``computed`` tokens not stored yet (marked stored)."""
        c = self.chunk_size
        end = (computed // c) * c
        if end <= self.chunks_stored_to:
            return []
        self._grow_keys(token_ids, end)
        out = [object_ref(self.keys, s, s + c) for s in range(self.chunks_stored_to, end, c)]
        self.chunks_stored_to = end
        return out

    def tail_to_save(
        self, token_ids: Sequence[int], computed: int, *, exact: bool = False
    ) -> ObjectRef | None:
        """The tail of the first ``computed`` tokens, unless stored (then marked stored).

        With ``exact`` it ends at ``computed`` (a prompt's end: the same prompt
        again finds it); else at the last page boundary (a conversation's
        next round, which extends these tokens, finds it). None when it would
        end on a chunk boundary (the chunk is the object) or be empty, or when
        the chunks before it are not all stored (a tail is only found after
        its full chunks).
        """
        c, b = self.chunk_size, self.page_tokens
        end = computed if exact else (computed // b) * b
        start = (end // c) * c
        if end == start or end in self.tails_stored or self.chunks_stored_to < start:
            return None
        self._grow_keys(token_ids, end)
        self.tails_stored.add(end)
        return object_ref(self.keys, start, end)
