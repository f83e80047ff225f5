"""Blocking socket I/O of the data plane: exact reads, whole blocks as ``bytes``, gathered writes.

Both ends of the data plane move block bytes through a :class:`Stream`:

* **Reading a block** (:meth:`Stream.read_block`) on a plain socket is one
  ``recv(n, MSG_WAITALL)``: the kernel copies the bytes straight into the
  final immutable ``bytes`` object, which is what the Tier contract and the
  store keep — no intermediate buffer and no second copy. (``recv_into`` a
  ``bytearray`` then ``bytes(...)`` is one more copy of every block, and a
  second freshly allocated buffer to page-fault; see ``docs/server.md``.)
  TLS sockets do not take flags, so there a block is read into a
  ``bytearray`` of its exact size and copied once into ``bytes``.
* **Writing** (:meth:`Stream.write`) gathers header bytes and ``memoryview``
  s of stored blocks into ``sendmsg`` calls: one system call for many
  blocks, no copy in Python.
* **Deadlines.** Plain sockets stay in blocking mode with kernel timeouts
  (``SO_RCVTIMEO``/``SO_SNDTIMEO``), because Python's own timeouts switch
  the socket to non-blocking mode, where ``MSG_WAITALL`` has no effect. Each
  operation is bounded by the per-operation timeout or, if set, by what is
  left of an absolute deadline (:meth:`Stream.set_deadline`).

Every failure is a :class:`StreamError`: the peer closed
(:class:`StreamClosedError`), an operation ran out of time
(:class:`StreamTimeoutError`), or the socket failed (reset, broken pipe).
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
import time
from collections import deque
from collections.abc import Sequence

Buffer = bytes | bytearray | memoryview

_IOV_MAX = 512
"""Buffers per ``sendmsg`` call (Linux allows 1024)."""
_MIN_TIMEOUT = 0.001
"""Kernel timeouts of 0 mean "forever": never arm less than this."""


class StreamError(Exception):
    """A data-plane connection failed; it must be closed."""


class StreamClosedError(StreamError):
    """The peer closed the connection before the expected bytes came."""


class StreamTimeoutError(StreamError):
    """A read or write made no progress in time, or the deadline passed."""


def _timeval(seconds: float) -> bytes:
    seconds = max(seconds, _MIN_TIMEOUT)
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1_000_000))


class Stream:
    """A connected socket (plain or TLS) with bounded, exact reads and gathered writes.

    Args:
        sock: A connected TCP socket, or an ``ssl.SSLSocket`` whose handshake is done.
        timeout_s: Longest time one read or write may take (until
            :meth:`set_deadline` sets an absolute deadline).

    Not thread-safe: one thread uses a stream at a time.
    """

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self.sock = sock
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.bytes_in = 0
        """Bytes read so far (a caller can tell whether a peer answered at all)."""
        self._timeout = timeout_s
        self._deadline: float | None = None
        self._keep_timeout = False
        self._armed = -1.0
        if not self.tls:
            sock.settimeout(None)  # blocking: MSG_WAITALL works, kernel timeouts bound it
        self._arm(timeout_s)

    # -- deadlines ---------------------------------------------------------------

    def set_timeout(self, timeout_s: float) -> None:
        """Bound each following operation by ``timeout_s`` (clears the deadline)."""
        self._timeout = timeout_s
        self._deadline = None
        self._arm(timeout_s)

    def set_deadline(self, deadline: float | None, *, keep_timeout: bool = False) -> None:
        """Bound every following operation by the monotonic time ``deadline`` (``None``: clear).

        Each operation is armed with the time left (re-armed only when that
        drifted by more than 10 %, to save system calls), and loops check
        the deadline between system calls. With ``keep_timeout`` each
        operation stays bounded by the per-operation timeout too (a server's
        idle bound inside a request's total one).
        """
        self._deadline = deadline
        self._keep_timeout = keep_timeout
        if deadline is None:
            self._arm(self._timeout)

    def _left(self) -> float:
        """Arm the socket with the time left; the seconds armed."""
        if self._deadline is None:
            return self._timeout
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise StreamTimeoutError("the deadline passed")
        if self._keep_timeout and self._timeout < left:
            left = self._timeout
        self._arm(left)
        return left

    def _arm(self, seconds: float) -> None:
        # NOTE: re-arming costs a system call per direction; skip it while the
        # armed value is within 10 % of the wanted one (a deadline ticking down).
        if self._armed >= 0 and abs(self._armed - seconds) <= 0.1 * seconds:
            return
        if self.tls:
            self.sock.settimeout(max(seconds, _MIN_TIMEOUT))
        else:
            tv = _timeval(seconds)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self._armed = seconds

    # -- reads -------------------------------------------------------------------

    def _recv(self, n: int, waitall: bool) -> bytes:
        try:
            if self.tls:
                return self.sock.recv(n)
            return self.sock.recv(n, socket.MSG_WAITALL if waitall else 0)
        except (TimeoutError, BlockingIOError):
            raise StreamTimeoutError(f"no data for {self._armed:.3g} s") from None
        except OSError as e:
            raise StreamError(f"receive failed: {e}") from None

    def read_exact(self, n: int) -> bytes:
        """Exactly ``n`` bytes (headers: small ``n``).

        Raises:
            StreamError: closed, timed out or failed before ``n`` bytes came.
        """
        armed = self._left()
        start = time.monotonic()
        data = self._recv(n, True)
        if len(data) == n:
            self.bytes_in += n
            return data
        parts = [data]
        got = len(data)
        while got < n:
            if not data:
                raise StreamClosedError(f"the peer closed the connection after {got} of {n} bytes")
            if time.monotonic() - start >= armed * 0.99:
                raise StreamTimeoutError(f"only {got} of {n} bytes came in {armed:.3g} s")
            self._left()
            data = self._recv(n - got, True)
            parts.append(data)
            got += len(data)
        self.bytes_in += n
        return b"".join(parts)

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` completely.

        Raises:
            StreamError: closed, timed out or failed first.
        """
        got, n = 0, len(view)
        while got < n:
            self._left()
            try:
                k = self.sock.recv_into(view[got:])
            except (TimeoutError, BlockingIOError):
                raise StreamTimeoutError(f"no data for {self._armed:.3g} s") from None
            except OSError as e:
                raise StreamError(f"receive failed: {e}") from None
            if not k:
                raise StreamClosedError(f"the peer closed the connection after {got} of {n} bytes")
            got += k
        self.bytes_in += n

    def read_block(self, n: int) -> bytes:
        """Exactly ``n`` bytes as one new ``bytes`` object, copied once from the socket.

        Raises:
            StreamError: closed, timed out or failed before ``n`` bytes came.
        """
        if not self.tls:
            armed = self._left()
            start = time.monotonic()
            data = self._recv(n, True)
            if len(data) == n:
                self.bytes_in += n
                return data
            # Cut short (a signal, the peer closing, the timeout): finish in a buffer.
            if not data:
                raise StreamClosedError(f"the peer closed the connection before {n} bytes")
            if time.monotonic() - start >= armed * 0.99:
                raise StreamTimeoutError(f"only {len(data)} of {n} bytes came in {armed:.3g} s")
            buf = bytearray(n)
            buf[: len(data)] = data
            self.bytes_in += len(data)
            self.read_into(memoryview(buf)[len(data) :])
            return bytes(buf)
        buf = bytearray(n)
        self.read_into(memoryview(buf))
        return bytes(buf)

    def readable(self) -> bool:
        """Whether bytes (or the peer's close) are waiting now; never blocks."""
        if self.tls and self.sock.pending():  # type: ignore[attr-defined]
            return True
        poller = select.poll()
        try:
            poller.register(self.sock, select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True  # closed under us: as good as "something happened"

    # -- writes ------------------------------------------------------------------

    def write(self, parts: Sequence[Buffer]) -> None:
        """Send every byte of ``parts`` in order (gathered; no copies on a plain socket).

        Raises:
            StreamError: timed out or failed before everything was sent.
        """
        try:
            if self.tls:
                for p in parts:
                    self._left()
                    self.sock.sendall(p)
                return
            pending = deque(memoryview(p).cast("B") for p in parts if len(p))
            while pending:
                self._left()
                sent = self.sock.sendmsg(list(_first(pending, _IOV_MAX)))
                while sent:
                    head = pending[0]
                    if sent >= len(head):
                        sent -= len(head)
                        pending.popleft()
                    else:
                        pending[0] = head[sent:]
                        sent = 0
        except (TimeoutError, BlockingIOError):
            raise StreamTimeoutError(f"could not send for {self._armed:.3g} s") from None
        except OSError as e:
            raise StreamError(f"send failed: {e}") from None

    def discard(self, seconds: float) -> int:
        """Read and drop bytes until the peer closes, an error, or ``seconds`` pass; how many."""
        self.set_deadline(time.monotonic() + seconds)
        scratch = memoryview(bytearray(1 << 16))
        dropped = 0
        try:
            while True:
                self._left()
                n = self.sock.recv_into(scratch)
                if not n:
                    return dropped
                dropped += n
        except (StreamError, OSError):
            return dropped

    # -- the end -----------------------------------------------------------------

    def shutdown_write(self) -> None:
        """Tell the peer nothing more will be sent (it reads an end of stream); errors ignored."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            return

    def close(self) -> None:
        """Close the socket (idempotent)."""
        try:
            self.sock.close()
        except OSError:
            return


def _first(items: deque[memoryview], n: int) -> list[memoryview]:
    if len(items) <= n:
        return list(items)
    return [items[i] for i in range(n)]
