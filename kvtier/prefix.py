"""Which stored objects make up a request's longest stored prefix, at page granularity.

Shared by the connector (lookups, save plans), the router (matching a prompt
against every engine's keys) and the engine's KV events; it imports nothing
but :mod:`kvtier.keys`.

Objects are chunk-sized or shorter (see ``kvtier.keys.PrefixKeys``)::

    tokens   0        C        2C       3C            (C = chunk size, P = page)
    objects  [ full 0 ][ full 1 ][ tail: j pages  )
             key(0,C/P) key(1,C/P) key(2,j)

A full chunk object is saved once its C tokens are computed; a *tail* —
the part of a last, unfinished chunk — when a prompt's prefill ends (up to
the prompt's exact end, so the same prompt again recomputes one token) and
when a request ends (prompt plus what it generated, up to the last full
page: the next round of a conversation extends it). A lookup asks the
store, in one batched call, for the key of every page boundary of the
prompt and of its end; the prefix is the run of full chunks from token 0,
then the longest tail found inside the first chunk that is not stored whole.

NOTE: why tails and not one object per page: a page of SmolLM2 KV is
~360 KiB and a request's prefix would be hundreds of objects, each a tier
round trip and a header; a per-request tail keeps objects chunk-sized (few
round trips, little overhead) and still lets a prompt that was stored before
(the same prompt again, or the next round of a conversation, which extends
the last round's prompt and answer) recompute at most the tokens after its
last full page, as the engine's own prefix cache (G1) would. What tails do
not serve is a new suffix that forks *inside* another request's tail (two
questions about one document): that reuses the document's full chunks and
recomputes the rest of the fork's chunk (docs/architecture.md, "Keys").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.keys import ChunkKey, PrefixKeys


@dataclass(frozen=True)
class ObjectRef:
    """One stored object: tokens ``[start, end)`` under ``key``."""

    start: int
    end: int
    key: ChunkKey

    @property
    def num_tokens(self) -> int:
        """Tokens it holds."""
        return self.end - self.start


@dataclass(frozen=True)
class StoredPrefix:
    """The longest stored prefix: ``objects`` cover ``[0, num_tokens)`` in order."""

    num_tokens: int
    objects: tuple[ObjectRef, ...]

    def objects_from(self, token: int) -> list[ObjectRef]:
        """The objects that hold tokens at or after ``token``."""
        return [o for o in self.objects if o.end > token]


def object_ref(keys: PrefixKeys, start: int, end: int) -> ObjectRef:
    """The object for tokens ``[start, end)`` (``start`` a chunk start, ``end`` within its chunk)."""
    return ObjectRef(start, end, keys.key(end))


def longest_stored_prefix(
    keys: PrefixKeys, limit: int, present: Sequence[bool], step: int | None = None
) -> StoredPrefix:
    """The prefix made of stored objects, given which lookup keys are present.

    Args:
        keys: The request's keys.
        limit: Look no further than this many tokens.
        present: For each end of ``keys.lookup_ends(limit, step)``, whether an
            object ending there is stored.
        step: Granularity of the lookup (default: the keys' ``page_tokens``).
    """
    chunk = keys.namespace.chunk_size
    ends = keys.lookup_ends(limit, step)
    found = {end for end, p in zip(ends, present, strict=True) if p}
    objects: list[ObjectRef] = []
    start = 0
    while start + chunk <= limit and start + chunk in found:
        objects.append(object_ref(keys, start, start + chunk))
        start += chunk
    tail = max((e for e in found if start < e < start + chunk), default=None)
    if tail is not None:
        objects.append(object_ref(keys, start, tail))
    end = objects[-1].end if objects else 0
    return StoredPrefix(end, tuple(objects))
