"""A bare data-plane client for the tests: raw frames over a socket, replies parsed by hand.

It uses only the wire constants (:mod:`kvtier.wire.dataplane`), not
the remote tier's client, so the tests see exactly what is on the wire.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

from kvtier.wire import dataplane as wire


class RawConn:
    """One data-plane connection driven byte by byte.

    Args:
        port: The server's data port (on 127.0.0.1).
        timeout: Seconds any read may wait.
    """

    def __init__(self, port: int, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)

    def __enter__(self) -> RawConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def half_close(self) -> None:
        """No more bytes from us: the server reads an end of stream."""
        self.sock.shutdown(socket.SHUT_WR)

    def read_exact(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise EOFError(f"closed after {len(out)} of {n} bytes")
            out += chunk
        return bytes(out)

    def read_to_end(self) -> bytes:
        """Everything until the server closes (raises on timeout: the server must close)."""
        out = bytearray()
        while True:
            try:
                chunk = self.sock.recv(1 << 16)
            except ConnectionResetError:
                return bytes(out)
            if not chunk:
                return bytes(out)
            out += chunk

    def closed_by_server(self) -> bool:
        """Whether the server closed its side (reads an end of stream or a reset)."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def read_status(self) -> wire.Status:
        code, n = wire.STATUS.unpack(self.read_exact(wire.STATUS.size))
        return wire.Status(code, self.read_exact(n).decode() if n else "")

    def hello(self, token: str | None) -> wire.Status:
        """Shake hands; the server's STATUS."""
        self.send(wire.hello(token))
        magic, version = wire.HELLO_REPLY.unpack(self.read_exact(wire.HELLO_REPLY.size))
        assert magic == wire.MAGIC and version == wire.DATA_PROTOCOL_VERSION
        return self.read_status()

    def get(self, keys: Sequence[bytes]) -> list[bytes | None] | wire.Status:
        """The blocks, or the refusal's STATUS."""
        self.send(wire.REQUEST.pack(wire.OP_GET, len(keys)) + b"".join(keys))
        status = self.read_status()
        if not status.ok:
            return status
        out: list[bytes | None] = []
        for _ in keys:
            kind, n = wire.ITEM.unpack(self.read_exact(wire.ITEM.size))
            if kind == wire.KIND_ERROR:
                return self.read_status()
            out.append(self.read_exact(n) if kind == wire.KIND_HIT else None)
        return out

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> tuple[wire.Status, int]:
        """Send blocks; the STATUS and, if OK, how many blocks were stored."""
        self.send(put_request(items))
        status = self.read_status()
        if not status.ok:
            return status, 0
        blocks, _ = wire.PUT_DONE.unpack(self.read_exact(wire.PUT_DONE.size))
        return status, blocks


def put_request(items: Sequence[tuple[bytes, bytes]]) -> bytes:
    return wire.REQUEST.pack(wire.OP_PUT, len(items)) + b"".join(
        wire.PUT_ITEM.pack(k, len(b)) + b for k, b in items
    )


def parse_statuses(reply: bytes) -> list[wire.Status]:
    """The STATUS frames at the start of ``reply`` (HELLO_REPLY first if present), best effort."""
    out: list[wire.Status] = []
    pos = 0
    if reply[:4] == wire.MAGIC:
        pos = wire.HELLO_REPLY.size
    while pos + wire.STATUS.size <= len(reply):
        code, n = wire.STATUS.unpack_from(reply, pos)
        pos += wire.STATUS.size
        out.append(wire.Status(code, reply[pos : pos + n].decode("utf-8", "replace")))
        pos += n
        if code == wire.OK:
            break
    return out
