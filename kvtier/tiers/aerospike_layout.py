"""How blocks map onto Aerospike records (pure functions, no I/O).

A block that fits under the namespace's record cap is **one record** with one
bin, ``b``, holding the block. A larger block becomes **segment records**
plus one **manifest record**::

    primary key  = chunk key (16 B)               bin "m": manifest  (the commit point)
    segment key  = chunk key ‖ nonce (8 B) ‖ i    bin "s": bytes [i*segment_size, (i+1)*segment_size)
                   (i: u32 big-endian)

The manifest (bin ``m``) is a small fixed header followed by a copy of the
block's first bytes (its kvtier header)::

    offset size  field
    0      4     magic "KVAM"
    4      1     manifest version (1)
    5      1     checksum kind (1 = xxh3_64 of the whole block; 2 = a kvtier block's identity)
    6      2     reserved (0)
    8      4     segment count
    12     4     segment size (bytes; the last segment may be shorter)
    16     8     block length
    24     8     checksum (kind 1) or identity (kind 2) of the block
    32     8     nonce (the chunk key's canonical nonce, or random)
    40     2     head length (min(64, block length))
    42     ...   head: the block's first bytes

**Checksum kinds.** Kind 1 (any bytes): the xxh3_64 of the whole block, which a
reader computes again over the joined segments. Kind 2 (a block in kvtier's
format, :mod:`kvtier.block`, which carries an xxh64 of its own body in its
header): the block's *identity*, an xxh3_64 of its header (and so of its
body's checksum, key and shape) and of what follows its body (a provenance
trailer), a few hundred bytes; and every segment record carries it in a second
bin, ``t`` (the tag: identity and segment size). A reader of a kind-2 block
checks every segment's tag, its length, the head and the identity, never the
body: the consumer of a block it returns verifies the body's checksum anyway
(:class:`~kvtier.store.TieredStore` does for every tier that does not
:attr:`~kvtier.tiers.base.Tier.verifies_reads`), and a pass of the tier's own
over 11-32 MiB on every get and put was the one CPU cost the raw client does
not have (``bench/tier_load.py``). What the tags catch is what only the tier
can: segments of two writers' different blocks under one canonical nonce. A
flipped bit inside a body is the consumer's checksum mismatch: a counted miss.

A manifest names segments that hold its block's bytes. A writer first tries
the chunk key's **canonical nonce** (:func:`canonical_nonce`, derived from the
key alone) and writes its segments create-only, with its manifest in the same
request: a reader who knows the key can then ask for the manifest and the
segments in one batch. Segments it created are its own; any that already
existed (another writer of the chunk, or orphans of a dead one) it reads back
once: the same bytes are kept, other bytes make it write its segments again
under a random nonce, which no one else can name, and replace its manifest.
Primary and segment keys have different lengths, so they can never collide.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvtier.block import HEADER_SIZE, read_header
from kvtier.errors import CorruptBlockError

BIN_BLOCK = "b"
"""Bin of a single-record block."""
BIN_MANIFEST = "m"
"""Bin of a manifest record."""
BIN_SEGMENT = "s"
"""Bin of a segment record."""
BIN_TAG = "t"
"""Bin of a kind-2 segment record: the tag of the block it belongs to (:meth:`Manifest.tag`)."""

HEAD_BYTES = 64
"""Bytes of the block copied into the manifest (of a kvtier block: the first 64 of its
80-byte header: magic, shape, lengths and the body's checksum)."""
NONCE_BYTES = 8
MAX_SEGMENTS = 1 << 16
"""A manifest naming more segments is rejected (a damaged manifest must not make a
reader ask for millions of keys); with 1 MiB records that is a 64 GiB block."""

_MAGIC = b"KVAM"
_VERSION = 1
CHECKSUM_XXH3 = 1
"""Checksum kind: xxh3_64 of the whole block, verified by the tier on read."""
CHECKSUM_KVTB = 2
"""Checksum kind: a kvtier block's identity; segments tagged (see the module docstring)."""
_HEADER = struct.Struct("<4sBBHIIQQ8sH")
_SEGMENT_INDEX = struct.Struct(">I")
_TAG = struct.Struct("<QI")  # identity, segment size


class ManifestError(ValueError):
    """A manifest record's bytes are not a valid manifest."""


def block_checksum(block: bytes | memoryview) -> int:
    """The checksum a kind-1 manifest stores for a whole block (xxh3_64)."""
    return xxhash.xxh3_64_intdigest(block)


def block_identity(block: bytes | bytearray | memoryview) -> int | None:
    """A kvtier block's identity (kind 2), or ``None`` if ``block`` is not one.

    An xxh3_64 of its header and of the bytes after its body: the header holds
    the xxh64 of the body, so two blocks with one identity hold one body (the
    consumer checks the body against it). Reads the header's lengths only.
    """
    try:
        header = read_header(block)
    except CorruptBlockError:
        return None
    view = memoryview(block)
    h = xxhash.xxh3_64(view[:HEADER_SIZE])
    h.update(view[header.total_len :])
    return h.intdigest()


def canonical_nonce(chunk_key: bytes) -> bytes:
    """The nonce a reader can compute from the chunk key alone (see the module docstring)."""
    return xxhash.xxh3_64_digest(b"kvtier-segments\0" + chunk_key)


def segment_key(chunk_key: bytes, nonce: bytes, index: int) -> bytes:
    """The user key of segment ``index`` of the write identified by ``nonce``."""
    return chunk_key + nonce + _SEGMENT_INDEX.pack(index)


def segment_count(length: int, segment_size: int) -> int:
    return max(1, -(-length // segment_size))


@dataclass(frozen=True)
class Manifest:
    """The commit record of a segmented block."""

    n_segments: int
    segment_size: int
    length: int
    checksum: int
    nonce: bytes
    head: bytes
    kind: int = CHECKSUM_XXH3

    @classmethod
    def for_block(cls, block: bytes, segment_size: int, nonce: bytes | None = None) -> Manifest:
        """A manifest for writing ``block`` in segments of ``segment_size`` bytes, with a fresh
        nonce (or ``nonce``): kind 2 for a kvtier block, else kind 1 (one pass over it)."""
        if segment_size <= 0:
            raise ValueError(f"segment_size must be positive, got {segment_size}")
        identity = block_identity(block)
        return cls(
            n_segments=segment_count(len(block), segment_size),
            segment_size=segment_size,
            length=len(block),
            checksum=block_checksum(block) if identity is None else identity,
            nonce=nonce if nonce is not None else os.urandom(NONCE_BYTES),
            head=bytes(block[:HEAD_BYTES]),
            kind=CHECKSUM_XXH3 if identity is None else CHECKSUM_KVTB,
        )

    @property
    def tag(self) -> bytes | None:
        """What each segment record of a kind-2 block carries in bin ``t`` (``None``: kind 1).

        The identity and the segment size: another writer's segment of the same block
        (same identity) cut at the same size holds the same bytes."""
        if self.kind != CHECKSUM_KVTB:
            return None
        return _TAG.pack(self.checksum, self.segment_size)

    def same_block(self, other: Manifest) -> bool:
        """Whether ``other`` names the same bytes cut the same way (checksum kind and value,
        length, segment size)."""
        return (self.kind, self.checksum, self.length, self.segment_size) == (
            other.kind,
            other.checksum,
            other.length,
            other.segment_size,
        )

    def encode(self) -> bytes:
        return (
            _HEADER.pack(
                _MAGIC,
                _VERSION,
                self.kind,
                0,
                self.n_segments,
                self.segment_size,
                self.length,
                self.checksum,
                self.nonce,
                len(self.head),
            )
            + self.head
        )

    @classmethod
    def decode(cls, data: bytes | bytearray) -> Manifest:
        """Parse and check a manifest.

        Raises:
            ManifestError: the bytes are not a consistent manifest.
        """
        if len(data) < _HEADER.size:
            raise ManifestError(f"manifest is {len(data)} bytes, shorter than its header")
        magic, version, kind, reserved, n, seg, length, checksum, nonce, head_len = (
            _HEADER.unpack_from(data, 0)
        )
        if magic != _MAGIC:
            raise ManifestError(f"bad manifest magic {magic!r}")
        if version != _VERSION or kind not in (CHECKSUM_XXH3, CHECKSUM_KVTB) or reserved:
            raise ManifestError(f"unsupported manifest version {version} / checksum kind {kind}")
        if seg <= 0 or length <= 0 or n != segment_count(length, seg) or n > MAX_SEGMENTS:
            raise ManifestError(f"inconsistent manifest: {n} segments of {seg} B for {length} B")
        if head_len != min(HEAD_BYTES, length) or len(data) != _HEADER.size + head_len:
            raise ManifestError(f"manifest head of {head_len} B does not fit a {length}-byte block")
        return cls(n, seg, length, checksum, nonce, bytes(data[_HEADER.size :]), kind)

    def segment_keys(self, chunk_key: bytes) -> list[bytes]:
        return [segment_key(chunk_key, self.nonce, i) for i in range(self.n_segments)]

    def segment_length(self, index: int) -> int:
        if index < self.n_segments - 1:
            return self.segment_size
        return self.length - self.segment_size * (self.n_segments - 1)

    def split(self, block: bytes) -> list[bytes]:
        """The segments of ``block`` (copies: the client rejects memoryviews)."""
        size = self.segment_size
        return [block[i * size : (i + 1) * size] for i in range(self.n_segments)]

    def assemble(
        self,
        segments: Sequence[bytes | bytearray],
        tags: Sequence[bytes | bytearray | None] | None = None,
    ) -> bytes | None:
        """Join segments back into the block; ``None`` if lengths, head or checksum disagree.

        Kind 2: ``tags`` (each segment record's bin ``t``) must all be :attr:`tag`, and
        the identity is checked instead of a checksum of the whole block (see the module
        docstring: the body is its consumer's to verify).
        """
        if len(segments) != self.n_segments:
            return None
        for i, seg in enumerate(segments):
            if len(seg) != self.segment_length(i):
                return None
        want = self.tag
        if want is not None and (
            tags is None or len(tags) != self.n_segments or any(t != want for t in tags)
        ):
            return None
        block = b"".join(segments)
        if block[:HEAD_BYTES] != self.head:
            return None
        if want is None:
            return block if block_checksum(block) == self.checksum else None
        return block if block_identity(block) == self.checksum else None
