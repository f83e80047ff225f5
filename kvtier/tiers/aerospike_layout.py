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
    5      1     checksum kind (1 = xxh3_64 of the whole block)
    6      2     reserved (0)
    8      4     segment count
    12     4     segment size (bytes; the last segment may be shorter)
    16     8     block length
    24     8     checksum of the whole block
    32     8     nonce (the chunk key's canonical nonce, or random)
    40     2     head length (min(64, block length))
    42     ...   head: the block's first bytes

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

BIN_BLOCK = "b"
"""Bin of a single-record block."""
BIN_MANIFEST = "m"
"""Bin of a manifest record."""
BIN_SEGMENT = "s"
"""Bin of a segment record."""

HEAD_BYTES = 64
"""Bytes of the block copied into the manifest (the size of a kvtier block header)."""
NONCE_BYTES = 8
MAX_SEGMENTS = 1 << 16
"""A manifest naming more segments is rejected (a damaged manifest must not make a
reader ask for millions of keys); with 1 MiB records that is a 64 GiB block."""

_MAGIC = b"KVAM"
_VERSION = 1
_CHECKSUM_XXH3_64 = 1
_HEADER = struct.Struct("<4sBBHIIQQ8sH")
_SEGMENT_INDEX = struct.Struct(">I")


class ManifestError(ValueError):
    """A manifest record's bytes are not a valid manifest."""


def block_checksum(block: bytes | memoryview) -> int:
    """The checksum a manifest stores for a whole block (xxh3_64)."""
    return xxhash.xxh3_64_intdigest(block)


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

    @classmethod
    def for_block(cls, block: bytes, segment_size: int, nonce: bytes | None = None) -> Manifest:
        """A manifest for writing ``block`` in segments of ``segment_size`` bytes, with a fresh nonce."""
        if segment_size <= 0:
            raise ValueError(f"segment_size must be positive, got {segment_size}")
        return cls(
            n_segments=segment_count(len(block), segment_size),
            segment_size=segment_size,
            length=len(block),
            checksum=block_checksum(block),
            nonce=nonce if nonce is not None else os.urandom(NONCE_BYTES),
            head=bytes(block[:HEAD_BYTES]),
        )

    def encode(self) -> bytes:
        return (
            _HEADER.pack(
                _MAGIC,
                _VERSION,
                _CHECKSUM_XXH3_64,
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
        if version != _VERSION or kind != _CHECKSUM_XXH3_64 or reserved:
            raise ManifestError(f"unsupported manifest version {version} / checksum kind {kind}")
        if seg <= 0 or length <= 0 or n != segment_count(length, seg) or n > MAX_SEGMENTS:
            raise ManifestError(f"inconsistent manifest: {n} segments of {seg} B for {length} B")
        if head_len != min(HEAD_BYTES, length) or len(data) != _HEADER.size + head_len:
            raise ManifestError(f"manifest head of {head_len} B does not fit a {length}-byte block")
        return cls(n, seg, length, checksum, nonce, bytes(data[_HEADER.size :]))

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

    def assemble(self, segments: Sequence[bytes | bytearray]) -> bytes | None:
        """Join segments back into the block; ``None`` if lengths, head or checksum disagree."""
        if len(segments) != self.n_segments:
            return None
        for i, seg in enumerate(segments):
            if len(seg) != self.segment_length(i):
                return None
        block = b"".join(segments)
        if block[:HEAD_BYTES] != self.head or block_checksum(block) != self.checksum:
            return None
        return block
