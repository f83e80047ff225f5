"""Who wrote a block: the provenance trailer, stamped and checked with per-writer HMAC keys.

A shared tier is written by several principals (engines, each with its own
token on the cache server). The cache server knows who each caller is, so it
*stamps* every block it stores with the writer's name and a tag only it can
make, and it answers every reader only with blocks whose writer that reader
accepts (``docs/security.md``, "Provenance")::

    body (header ‖ scales ‖ payload, kvtier/block.py)  ‖  trailer (104 bytes)

    trailer  offset size
             0      4     magic b"KVTW"
             4      1     version (1)
             5      1     writer name length n (1..64)
             6      2     reserved (0)
             8      64    writer name (ASCII, zero-padded)
             72     32    tag = HMAC-SHA256(k_w, DOMAIN ‖ scope ‖ n ‖ name ‖ SHA-256(body))

``k_w = HMAC-SHA256(secret, "kvtier-writer-key-v1\\0" ‖ name)`` is the
writer's key, derived from the stamping server's secret: a writer never
holds a key (the server stamps the name its token authenticated), and a
verifier can be given one writer's key without being able to make tags of
any other writer. ``scope`` is the 16-byte key the block is stored under, so
a stamped block moved to another key — another namespace, another trust
class — no longer verifies. The tag covers a SHA-256 of the body: the body's
xxh64 checksum catches accidents, not a forger (xxh64 is not collision
resistant).

A block a writer sends with a trailer of its own is re-stamped: nobody but
the server chooses the name. Checking a tag costs one SHA-256 pass over the
block (``bench/RESULTS.md``), so the server checks tags where blocks come
back from storage others can write (an Aerospike backend), not from its own
memory or its private disk directory.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

from kvtier.block import TRAILER_MAGIC, TRAILER_SIZE, read_header
from kvtier.errors import ProvenanceError

DOMAIN = b"kvtier-provenance-v1\0"
_KEY_DOMAIN = b"kvtier-writer-key-v1\0"
_VERSION = 1
NAME_MAX = 64
_TRAILER = struct.Struct("<4sBB2s64s32s")
assert _TRAILER.size == TRAILER_SIZE


@dataclass(frozen=True)
class Provenance:
    """A block's trailer: who wrote it and the tag that binds that to the block."""

    writer: str
    tag: bytes


def writer_key(secret: bytes, writer: str) -> bytes:
    """The HMAC key of ``writer`` under the stamping server's ``secret``."""
    return hmac.new(secret, _KEY_DOMAIN + writer.encode(), hashlib.sha256).digest()


def _body(block: bytes | memoryview) -> memoryview:
    """The block without its trailer (a view; the header is validated first)."""
    header = read_header(block)
    return memoryview(block)[: header.total_len]


def _tag(key: bytes, scope: bytes, name: bytes, body: memoryview) -> bytes:
    digest = hashlib.sha256(body).digest()
    msg = DOMAIN + scope + bytes([len(name)]) + name + digest
    return hmac.new(key, msg, hashlib.sha256).digest()


def _name(writer: str) -> bytes:
    name = writer.encode()
    if not 1 <= len(name) <= NAME_MAX or not writer.isascii():
        raise ValueError(f"a writer name is 1-{NAME_MAX} ASCII characters, got {writer!r}")
    return name


def stamp(block: bytes, *, writer: str, secret: bytes, scope: bytes) -> bytes:
    """``block`` (any trailer it had dropped) with a trailer naming ``writer``.

    Args:
        block: A valid block (its header is parsed; its checksum is the caller's to check).
        writer: Who wrote it (the name its caller authenticated as).
        secret: The stamping server's secret.
        scope: The key the block is stored under.

    Raises:
        CorruptBlockError: the header is not valid.
        ValueError: the writer name cannot be stamped.
    """
    name = _name(writer)
    body = _body(block)
    tag = _tag(writer_key(secret, writer), scope, name, body)
    trailer = _TRAILER.pack(TRAILER_MAGIC, _VERSION, len(name), b"\0\0", name, tag)
    return b"".join((body, trailer))


def provenance_of(block: bytes | memoryview) -> Provenance | None:
    """The trailer of a block that passed :func:`~kvtier.block.read_header`; ``None``: unstamped.

    Raises:
        ProvenanceError: the trailer is malformed.
    """
    if len(block) < TRAILER_SIZE:
        return None
    header = read_header(block)
    if len(block) == header.total_len:
        return None
    magic, version, n, reserved, name, tag = _TRAILER.unpack_from(block, header.total_len)
    if magic != TRAILER_MAGIC or version != _VERSION or reserved != b"\0\0":
        raise ProvenanceError(f"provenance trailer of version {version} is not readable here")
    if not 1 <= n <= NAME_MAX or any(name[n:]):
        raise ProvenanceError(f"provenance trailer names a writer of {n} bytes")
    try:
        writer = name[:n].decode("ascii")
    except UnicodeDecodeError:
        raise ProvenanceError("provenance trailer names a writer that is not ASCII") from None
    return Provenance(writer, tag)


def check(block: bytes | memoryview, *, secret: bytes, scope: bytes) -> str:
    """The writer of a stamped block whose tag verifies under ``secret`` for ``scope``.

    Raises:
        ProvenanceError: the block is unstamped, its trailer malformed, or its tag wrong.
    """
    prov = provenance_of(block)
    if prov is None:
        raise ProvenanceError("the block carries no provenance stamp")
    name = prov.writer.encode()
    want = _tag(writer_key(secret, prov.writer), scope, name, _body(block))
    if not hmac.compare_digest(want, prov.tag):
        raise ProvenanceError(
            f"the provenance tag of writer {prov.writer!r} does not verify (block, writer or "
            "key changed after it was stamped)"
        )
    return prov.writer


def unstamped(block: bytes) -> bytes | memoryview:
    """``block`` without its trailer: a view when it has one, else the block itself."""
    n = read_header(block).total_len
    return block if len(block) == n else memoryview(block)[:n]


def writer_of(block: bytes | memoryview) -> str | None:
    """The writer a block's trailer names (unchecked), ``None`` if unstamped or unreadable."""
    try:
        prov = provenance_of(block)
    except ProvenanceError:
        return None
    return None if prov is None else prov.writer
