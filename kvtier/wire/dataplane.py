"""The bulk data plane's wire format, version 1: fixed big-endian headers, explicit lengths.

A TCP connection (TLS when the server's gRPC uses TLS) carries one
handshake, then any number of requests, one at a time::

    client                                        server
    HELLO   "KVDP" version:u16 token_len:u16 token ─►
                                              ◄─ HELLO_REPLY "KVDP" version:u16 · STATUS
    GET     op=1:u8 count:u32 · count × key[16] ─►
                                              ◄─ STATUS · count × (ITEM · block bytes if hit)
    PUT     op=2:u8 count:u32 · count × (key[16] length:u64 · length block bytes) ─►
                                              ◄─ STATUS · (if OK) blocks:u32 bytes:u64

    STATUS  code:u8 message_len:u16 · message (UTF-8)      code: a gRPC status number, 0 = OK
    ITEM    kind:u8 length:u64      kind 0 miss (length 0) · 1 hit · 2 error (a STATUS follows)

* A token of length 0 is "no token" (served only by an open server).
* A reply whose STATUS is not OK ends the connection: the server closes it
  after sending (best effort: a connection it cannot read any more, it
  closes at once). A GET reply that started OK and then fails sends an
  error ITEM, its STATUS, and closes.
* The server checks ``count`` and each block's ``length`` against its
  limits before reading what follows, and stores a PUT's block only when all
  its bytes came and it is a valid kvtier block; blocks before a refused one
  are stored (each whole and valid), like a gRPC Put stream.

Status codes are gRPC's numbers (:data:`STATUS_NAMES`), so both planes map
onto the same client errors. This module is part of the protocol leaf: the
remote tier imports it without importing the server.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

MAGIC = b"KVDP"
DATA_PROTOCOL_VERSION = 1
"""Bumped with every incompatible change to this format (advertised in ``Health``)."""

KEY_SIZE = 16
MAX_TOKEN = 4096
"""Longest token a HELLO may carry (bytes)."""
MAX_MESSAGE = 2048
"""Longest STATUS message a sender writes (bytes; longer ones are cut)."""

OP_GET = 1
OP_PUT = 2

KIND_MISS = 0
KIND_HIT = 1
KIND_ERROR = 2

HELLO = struct.Struct(">4sHH")  # magic, version, token length; then the token
HELLO_REPLY = struct.Struct(">4sH")  # magic, version; then a STATUS
STATUS = struct.Struct(">BH")  # code, message length; then the message
REQUEST = struct.Struct(">BI")  # op, count
ITEM = struct.Struct(">BQ")  # kind, length
PUT_ITEM = struct.Struct(">16sQ")  # key, length
PUT_DONE = struct.Struct(">IQ")  # blocks stored, bytes stored

OK = 0
STATUS_NAMES = {
    0: "OK",
    1: "CANCELLED",
    2: "UNKNOWN",
    3: "INVALID_ARGUMENT",
    4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND",
    6: "ALREADY_EXISTS",
    7: "PERMISSION_DENIED",
    8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION",
    10: "ABORTED",
    11: "OUT_OF_RANGE",
    12: "UNIMPLEMENTED",
    13: "INTERNAL",
    14: "UNAVAILABLE",
    15: "DATA_LOSS",
    16: "UNAUTHENTICATED",
}
"""gRPC status numbers and names (``grpc.StatusCode[name]``)."""


class Status(NamedTuple):
    """A decoded STATUS."""

    code: int
    message: str

    @property
    def ok(self) -> bool:
        return self.code == OK

    @property
    def name(self) -> str:
        return STATUS_NAMES.get(self.code, f"code {self.code}")


def hello(token: str | None) -> bytes:
    """The client's handshake.

    Raises:
        ValueError: the token is longer than :data:`MAX_TOKEN` bytes.
    """
    raw = (token or "").encode()
    if len(raw) > MAX_TOKEN:
        raise ValueError(f"a data-plane token is at most {MAX_TOKEN} bytes, this one {len(raw)}")
    return HELLO.pack(MAGIC, DATA_PROTOCOL_VERSION, len(raw)) + raw


def status(code: int, message: str = "") -> bytes:
    """An encoded STATUS (the message cut to :data:`MAX_MESSAGE` bytes)."""
    raw = message.encode("utf-8", "replace")[:MAX_MESSAGE]
    return STATUS.pack(code, len(raw)) + raw


OK_STATUS = status(OK)
MISS_ITEM = ITEM.pack(KIND_MISS, 0)


def hello_reply(code: int, message: str = "") -> bytes:
    """The server's answer to a HELLO."""
    return HELLO_REPLY.pack(MAGIC, DATA_PROTOCOL_VERSION) + status(code, message)
