"""The remote tier's data-plane client: Get and Put of block bytes over the server's bulk data port.

The server advertises its data plane in ``Health`` (``data_port``,
``data_protocol_version``); the wire format is
:mod:`kvtier.wire.dataplane`. gRPC remains the control plane
(Health, Lookup, Exists, Delete, Stats) and the fallback for Get and Put.

* **Connections.** A small pool of persistent connections, each
  authenticated once by its handshake (the tier's bearer token); a call
  takes an idle one or opens one, and gives it back after a clean
  exchange, so each concurrent caller has its own and none is shared. A
  connection that saw any error is closed. An idle connection the server
  has closed meanwhile is noticed before use; if one fails before the
  server answered a byte, the exchange runs once more on a fresh
  connection (Get and Put are idempotent).
* **Copies.** A block is read by one ``recv(n, MSG_WAITALL)`` straight into
  the ``bytes`` the Tier contract returns (TLS: into a ``bytearray`` of its
  exact size, then one copy into ``bytes``); a put sends the caller's
  ``bytes`` by gathered ``sendmsg`` without copying them.
* **Deadlines.** Connecting and the handshake are bounded by ``timeout_s``;
  every read and write of an exchange by what is left of its deadline
  (``transfer_timeout_s``). A ``get`` given a caller's ``deadline`` ends by
  the earlier of the two, connecting and the handshake included; each socket
  operation is armed with what is left (re-armed when it drifts by more than
  10 %), so a read ends at most a tenth of the time left when it started
  after the deadline.
* **Errors.** No connection, a failed or refused handshake (other than an
  auth refusal) raise :class:`DataPlaneUnavailableError`: the tier falls
  back to gRPC. Once connected, a broken or stalled connection raises
  :class:`RemoteRetryableError`; a STATUS from the server maps like the
  gRPC status of the same number; a reply that breaks the protocol raises
  :class:`RemoteProtocolError`.

Thread-safe.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc

from kvtier.tiers.remote_errors import (
    DataPlaneUnavailableError,
    RemoteAuthError,
    RemoteProtocolError,
    RemoteRetryableError,
    error_for_status,
    status_code,
)
from kvtier.wire import dataplane as wire
from kvtier.wire.sockio import Stream, StreamError, StreamTimeoutError

T = TypeVar("T")

_LIMIT_CODES = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT})
_AUTH_CODES = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
_REFUSAL_READ_S = 0.5
"""After a failed send, how long to wait for the STATUS that explains it."""


def client_tls_context(ca_file: str | None) -> ssl.SSLContext:
    """TLS for the data plane: verify the server against ``ca_file`` (default: the system's roots)."""
    return ssl.create_default_context(cafile=ca_file)


class DataPlaneClient:
    """Get and Put over one server's data plane, with a pool of persistent connections.

    Args:
        tier: The tier's name (for messages).
        host: The server's host.
        port: Its data port.
        token: Bearer token (``None``: none).
        on_connect: Called for each connection opened (counting).
        tls: Client TLS context, or ``None`` for plain TCP.
        server_hostname: The name TLS checks (default: ``host``).
        connect_timeout_s: Bound of connecting and of the handshake.
        max_idle: Idle connections kept for reuse.
        on_limit_refusal: Called when the server refuses a request with
            RESOURCE_EXHAUSTED or INVALID_ARGUMENT, or answers outside the
            protocol (e.g. a block over the limit we know): the tier asks
            for the server's limits again.
    """

    def __init__(
        self,
        tier: str,
        host: str,
        port: int,
        token: str | None,
        *,
        on_connect: Callable[[], None] | None = None,
        tls: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        connect_timeout_s: float = 1.0,
        max_idle: int = 8,
        on_limit_refusal: Callable[[], None] | None = None,
    ) -> None:
        self.tier = tier
        self.host = host.strip("[]")
        self.port = port
        self._hello = wire.hello(token)
        self._on_connect = on_connect
        self._tls = tls
        self._server_hostname = server_hostname or self.host
        self._connect_timeout_s = connect_timeout_s
        self._max_idle = max_idle
        self._on_limit_refusal = on_limit_refusal
        self._idle: list[Stream] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    # -- the calls -------------------------------------------------------------------

    def get(
        self,
        keys: Sequence[bytes],
        *,
        max_block_size: int,
        timeout_s: float,
        deadline: float | None = None,
    ) -> list[bytes | None]:
        """The block of each key (``None``: a miss), in order, over one connection.

        The exchange ends within ``timeout_s`` or by ``deadline`` (a
        :func:`time.monotonic` instant that also bounds connecting), whichever
        comes first.

        Raises:
            DataPlaneUnavailableError: no connection could be made (fall back to gRPC).
            RemoteRetryableError: the connection broke or stalled; the server is busy.
            RemoteAuthError, RemoteServerError, RemoteProtocolError: see the module.
        """
        _check_keys(self.tier, keys)
        end = time.monotonic() + timeout_s
        if deadline is not None:
            end = min(end, deadline)
        request = [wire.REQUEST.pack(wire.OP_GET, len(keys)), b"".join(keys)]

        def exchange(stream: Stream) -> list[bytes | None]:
            stream.set_deadline(end)
            stream.write(request)
            self._expect_ok(stream, "get")
            out: list[bytes | None] = []
            for i in range(len(keys)):
                kind, length = wire.ITEM.unpack(stream.read_exact(wire.ITEM.size))
                if kind == wire.KIND_HIT:
                    if not 0 < length <= max_block_size:
                        raise self._broken(f"key #{i}: a block of {length} bytes")
                    out.append(stream.read_block(length))
                elif kind == wire.KIND_MISS and length == 0:
                    out.append(None)
                elif kind == wire.KIND_ERROR:
                    raise self._status_error(_read_status(stream), "get")
                else:
                    raise self._broken(f"key #{i}: item kind {kind} with length {length}")
            return out

        return self._exchange("get", exchange, deadline)

    def put(self, items: Sequence[tuple[bytes, bytes]], *, timeout_s: float) -> int:
        """Send blocks over one connection; how many the server stored.

        Raises:
            Like :meth:`get`.
        """
        _check_keys(self.tier, [k for k, _ in items])
        deadline = time.monotonic() + timeout_s
        parts: list[bytes] = [wire.REQUEST.pack(wire.OP_PUT, len(items))]
        for key, block in items:
            parts.append(wire.PUT_ITEM.pack(key, len(block)))
            parts.append(block)  # sent from the caller's bytes, not copied

        def exchange(stream: Stream) -> int:
            stream.set_deadline(deadline)
            try:
                stream.write(parts)
            except StreamError:
                # The server may have refused a block and closed: its STATUS says why.
                refusal = self._refusal_after_failed_send(stream)
                if refusal is None:
                    raise
                raise self._status_error(refusal, "put") from None
            self._expect_ok(stream, "put")
            blocks, _ = wire.PUT_DONE.unpack(stream.read_exact(wire.PUT_DONE.size))
            return int(blocks)

        return self._exchange("put", exchange)

    def close(self) -> None:
        """Close every idle connection; connections in use close when their call ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()

    # -- exchanges -------------------------------------------------------------------

    def _exchange(self, op: str, fn: Callable[[Stream], T], deadline: float | None = None) -> T:
        """``fn`` over a pooled connection; a new one is opened by ``deadline`` (if given)."""
        stream, reused = self._acquire(deadline)
        before = stream.bytes_in
        try:
            result = fn(stream)
        except StreamError as e:
            stream.close()
            if reused and stream.bytes_in == before and not isinstance(e, StreamTimeoutError):
                # An idle connection the server closed (idle timeout, restart) just now:
                # the request never reached it. Once more on a fresh connection.
                return self._exchange_fresh(op, fn, deadline)
            raise self._io_error(op, e) from None
        except BaseException:
            stream.close()
            raise
        self._release(stream)
        return result

    def _exchange_fresh(
        self, op: str, fn: Callable[[Stream], T], deadline: float | None = None
    ) -> T:
        stream = self._open(deadline)
        try:
            result = fn(stream)
        except StreamError as e:
            stream.close()
            raise self._io_error(op, e) from None
        except BaseException:
            stream.close()
            raise
        self._release(stream)
        return result

    def _expect_ok(self, stream: Stream, op: str) -> None:
        status = _read_status(stream)
        if not status.ok:
            raise self._status_error(status, op)

    def _refusal_after_failed_send(self, stream: Stream) -> wire.Status | None:
        try:
            stream.set_deadline(time.monotonic() + _REFUSAL_READ_S)
            status = _read_status(stream)
        except StreamError:
            return None
        return None if status.ok else status

    def _status_error(self, status: wire.Status, op: str) -> Exception:
        code = status_code(status.code)
        if code in _LIMIT_CODES and self._on_limit_refusal is not None:
            self._on_limit_refusal()
        return error_for_status(
            code,
            f"remote tier {self.tier!r}: data-plane {op} failed with {status.name}: {status.message}",
        )

    def _io_error(self, op: str, e: StreamError) -> RemoteRetryableError:
        return RemoteRetryableError(
            f"remote tier {self.tier!r}: data-plane {op} to {self.host}:{self.port} failed: {e}"
        )

    def _broken(self, what: str) -> RemoteProtocolError:
        if self._on_limit_refusal is not None:
            self._on_limit_refusal()  # a server restarted with other limits looks like this
        return RemoteProtocolError(
            f"remote tier {self.tier!r}: data-plane answer broke the protocol: {what}"
        )

    # -- the pool --------------------------------------------------------------------

    def _acquire(self, deadline: float | None = None) -> tuple[Stream, bool]:
        """An idle connection that is still good (``True``), or a new one (``False``)."""
        while True:
            with self._lock:
                stream = self._idle.pop() if self._idle else None
            if stream is None:
                return self._open(deadline), False
            if stream.readable():  # the server closed it (or sent what we never asked for)
                stream.close()
                continue
            return stream, True

    def _release(self, stream: Stream) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(stream)
                return
        stream.close()

    def _open(self, deadline: float | None = None) -> Stream:
        """Connect and shake hands, within ``connect_timeout_s`` and by ``deadline`` (if given).

        A connection cut short by the deadline is unavailable like any other:
        the attempt may fall back to gRPC (with what is left, if anything).

        Raises:
            DataPlaneUnavailableError: no connection, no or a refused handshake.
            RemoteAuthError: the server refused the token.
        """
        where = f"{self.host}:{self.port}"
        timeout = self._connect_timeout_s
        end: float | None = None
        if deadline is not None:
            end = min(time.monotonic() + timeout, deadline)
            timeout = max(0.001, end - time.monotonic())
        try:
            sock = socket.create_connection((self.host, self.port), timeout=timeout)
        except OSError as e:
            raise self._unavailable(f"cannot connect to {where}: {e}") from None
        stream: Stream | None = None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self._server_hostname)
            stream = Stream(sock, self._connect_timeout_s)
            if end is not None:
                stream.set_deadline(end)  # the whole handshake, not each of its reads
            stream.write([self._hello])
            magic, version = wire.HELLO_REPLY.unpack(stream.read_exact(wire.HELLO_REPLY.size))
            if magic != wire.MAGIC:
                raise self._unavailable(f"{where} is not a kvtier data plane")
            status = _read_status(stream)
            if not status.ok:
                code = status_code(status.code)
                message = (
                    f"remote tier {self.tier!r}: the data plane at {where} refused the "
                    f"handshake with {status.name}: {status.message}"
                )
                if code in _AUTH_CODES:
                    raise RemoteAuthError(message)
                raise DataPlaneUnavailableError(message)
            if version != wire.DATA_PROTOCOL_VERSION:
                raise self._unavailable(f"{where} speaks data-plane protocol {version}")
        except (StreamError, OSError) as e:
            sock.close()
            raise self._unavailable(f"handshake with {where} failed: {e}") from None
        except BaseException:
            sock.close()
            raise
        if self._on_connect is not None:
            self._on_connect()
        return stream

    def _unavailable(self, what: str) -> DataPlaneUnavailableError:
        return DataPlaneUnavailableError(f"remote tier {self.tier!r}: data plane: {what}")


def _read_status(stream: Stream) -> wire.Status:
    code, length = wire.STATUS.unpack(stream.read_exact(wire.STATUS.size))
    message = stream.read_exact(length).decode("utf-8", "replace") if length else ""
    return wire.Status(code, message)


def _check_keys(tier: str, keys: Sequence[bytes]) -> None:
    for i, k in enumerate(keys):
        if len(k) != wire.KEY_SIZE:
            raise RemoteProtocolError(
                f"remote tier {tier!r}: key #{i} is {len(k)} bytes; keys are exactly "
                f"{wire.KEY_SIZE} bytes"
            )
