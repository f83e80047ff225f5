"""The bulk data plane's listener: a TCP (optionally TLS) port beside gRPC for Get and Put of block bytes.

gRPC stays the control plane and a complete fallback; this port only moves
block bytes, without protobuf or HTTP/2 framing: the server writes stored
``bytes`` to the socket with gathered ``sendmsg`` (no copy in Python) and
reads a put block straight into the ``bytes`` object it stores. The wire
format is :mod:`kvtier.wire.dataplane`; one connection is served by
a :class:`~kvtier.server.dataplane_session.DataPlaneSession` on its own
thread (clients keep a few persistent connections, one per concurrent
caller).

::

    start()   bind host:data_port · accept thread
    accept    over data_max_connections authenticated: RESOURCE_EXHAUSTED and close;
              else a thread: TLS handshake (if configured) · session
    pending   until its handshake authenticates it, a connection is *pending*: it
              must send the handshake within data_handshake_timeout_s. One address may
              have data_max_pending_per_address *silent* pending connections (its peer
              has sent nothing): one more closes the oldest silent one. A connection
              whose handshake has arrived is not silent, however long the server takes
              to read it (an engine opens one connection per concurrent load or save,
              and on a busy host dozens of their handshakes wait for a core at once).
              All addresses may have data_max_pending: one more closes the oldest of
              the address holding the most. So silent sockets can neither fill the
              connection cap nor keep a tenant out
    tenant    an authenticated tenant may hold tenant_max_data_connections
    stop()    stop accepting · wake idle sessions (they close) · wait for
              requests in flight (grace) · then cut what is left
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import ssl
import threading
import time
from collections import OrderedDict

import grpc

from kvtier.errors import ConfigError
from kvtier.server.access import BlockAccess
from kvtier.server.admission import RequestError, over_limit
from kvtier.server.dataplane_session import DataPlaneSession
from kvtier.server.gate import Gate
from kvtier.server.metrics import ServerMetrics
from kvtier.server.tenants import Tenant
from kvtier.server_config import ServerConfig
from kvtier.wire import dataplane as wire
from kvtier.wire.sockio import Stream, StreamError

log = logging.getLogger(__name__)


def server_tls_context(
    cert_file: os.PathLike[str] | str, key_file: os.PathLike[str] | str
) -> ssl.SSLContext:
    """A TLS server context of the data plane (the same certificate as gRPC).

    Raises:
        ConfigError: the files cannot be loaded.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"server.tls: cannot load {cert_file} / {key_file}: {e}") from None
    return context


class DataPlaneServer:
    """Accepts data-plane connections and serves each on its own thread.

    Args:
        config: ``host``, ``data_port``, limits and timeouts.
        access: Block data as each tenant may see and store it.
        gate: Shared with the gRPC service (tenants, draining, budgets, metrics).
        metrics: Server metrics (``data_connections``).
        tls: Server-side TLS context, or ``None`` for plain TCP.
    """

    def __init__(
        self,
        config: ServerConfig,
        access: BlockAccess,
        gate: Gate,
        metrics: ServerMetrics,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.config = config
        self.access = access
        self.gate = gate
        self.metrics = metrics
        self.tls = tls
        self.port = 0
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._lock = threading.Lock()
        self._conns: dict[int, socket.socket] = {}  # thread ident -> its socket
        self._pending: OrderedDict[int, tuple[str, socket.socket]] = OrderedDict()  # oldest first
        self._heard: set[int] = set()  # pending connections whose peer has sent bytes
        self._tenant_of: dict[int, str] = {}  # thread ident -> its authenticated tenant
        self._per_tenant: dict[str, int] = {}
        self._threads: set[threading.Thread] = set()
        self._accepting: threading.Thread | None = None
        self._stopping = False

    def start(self) -> DataPlaneServer:
        """Bind and accept in the background.

        Raises:
            ConfigError: the port cannot be bound.
        """
        c = self.config
        assert c.data_port is not None, "the data plane is off (data_port: null)"
        family = socket.AF_INET6 if ":" in c.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((c.host.strip("[]"), c.data_port))
            sock.listen(128)
        except OSError as e:
            sock.close()
            raise ConfigError(
                f"server: cannot bind the data plane to {c.host}:{c.data_port}: {e.strerror or e}"
            ) from None
        self._listener = sock
        self.port = int(sock.getsockname()[1])
        self._accepting = threading.Thread(
            target=self._accept_loop, name="kvtier-data-accept", daemon=True
        )
        self._accepting.start()
        return self

    @property
    def connections(self) -> int:
        """Connections open now."""
        with self._lock:
            return len(self._conns)

    # -- accepting -------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        poller = select.poll()
        poller.register(self._listener, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while not self._stopping:
            ready = dict(poller.poll())
            if self._wake_r in ready or self._stopping:
                return
            try:
                conn, peer = self._listener.accept()
            except OSError as e:
                if self._stopping:
                    return
                log.warning("data plane: accept failed: %s", e)
                time.sleep(0.05)  # e.g. out of file descriptors: do not spin
                continue
            self._admit(conn, str(peer[0]))

    def _admit(self, conn: socket.socket, host: str) -> None:
        c = self.config
        evicted: list[socket.socket] = []
        with self._lock:
            full = len(self._conns) - len(self._pending) >= c.data_max_connections
            admitted = not full and not self._stopping
            if admitted:
                victim = self._pending_to_close(host)
                if victim is not None:
                    evicted.append(self._pending.pop(victim)[1])
                thread = threading.Thread(
                    target=self._serve, args=(conn,), name="kvtier-data-conn", daemon=True
                )
                self._threads.add(thread)
                thread.start()
                ident = thread.ident or 0
                self._conns[ident] = conn
                self._pending[ident] = (host, conn)
        for old in evicted:  # its thread's handshake read ends: the connection closes
            self.metrics.rejected.labels("limit").inc()
            with contextlib.suppress(OSError):
                old.shutdown(socket.SHUT_RDWR)
        if admitted:
            return
        # Refused before the handshake (plaintext reply; a TLS client just sees the close).
        self.metrics.rejected.labels("limit").inc()
        try:
            conn.settimeout(0.5)
            if self.tls is None:
                reason = (
                    "the server is shutting down"
                    if self._stopping
                    else f"more than {self.config.data_max_connections} data-plane connections"
                )
                code = (
                    grpc.StatusCode.UNAVAILABLE
                    if self._stopping
                    else grpc.StatusCode.RESOURCE_EXHAUSTED
                )
                conn.sendall(wire.hello_reply(code.value[0], reason))
        except OSError:
            pass
        finally:
            conn.close()

    def _pending_to_close(self, host: str) -> int | None:
        """The pending connection a new one from ``host`` closes, if any (under the lock).

        The oldest silent one of ``host`` once it has ``data_max_pending_per_address``
        pending; else, at ``data_max_pending``, the oldest of the address holding the most.
        """
        c = self.config
        same = [i for i, (h, _) in self._pending.items() if h == host]
        if len(same) >= c.data_max_pending_per_address:
            for ident in same:
                if self._silent(ident):
                    return ident
        if len(self._pending) < c.data_max_pending:
            return None
        held: dict[str, int] = {}
        for h, _ in self._pending.values():
            held[h] = held.get(h, 0) + 1
        most = max(held.values())
        return next(i for i, (h, _) in self._pending.items() if held[h] == most)

    def _silent(self, ident: int) -> bool:
        """Whether pending connection ``ident``'s peer has sent nothing yet (under the lock).

        Bytes it sent may still wait unread in the socket (its thread has not had a core
        yet): a poll without waiting sees them.
        """
        if ident in self._heard:
            return False
        conn = self._pending[ident][1]
        try:
            poller = select.poll()
            poller.register(conn, select.POLLIN)
            return not poller.poll(0)
        except (OSError, ValueError):  # closed meanwhile: its thread is ending
            return True

    def _await_first_bytes(self, conn: socket.socket, timeout: float) -> float:
        """Wait (up to ``timeout``) until the peer sends or closes, and count the calling
        connection as heard if it did; the seconds of ``timeout`` left.

        A peer silent throughout leaves ~0 s: its handshake read then times out at once
        and is counted as before (``data.Connect``, CANCELLED).
        """
        start = time.monotonic()
        poller = select.poll()
        poller.register(conn, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        ready = dict(poller.poll(timeout * 1000))
        if conn.fileno() in ready:
            with self._lock:
                self._heard.add(threading.get_ident())
        return max(0.001, timeout - (time.monotonic() - start))

    def _serve(self, conn: socket.socket) -> None:
        c = self.config
        me = threading.current_thread()
        self.metrics.data_connections.inc()
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            left = self._await_first_bytes(conn, c.data_handshake_timeout_s)
            sock = conn
            if self.tls is not None:
                conn.settimeout(left)
                sock = self.tls.wrap_socket(conn, server_side=True)
                with self._lock:
                    self._conns[me.ident or 0] = sock
            session = DataPlaneSession(
                Stream(sock, left if self.tls is None else c.data_handshake_timeout_s),
                self.access,
                self.gate,
                c,
                self.metrics,
                self._wake_r,
                self._authenticated,
            )
            session.run()
        except (OSError, ssl.SSLError, StreamError) as e:
            log.debug("data-plane connection failed before its session: %s", e)
        finally:
            conn.close()
            self.metrics.data_connections.dec()
            ident = me.ident or 0
            with self._lock:
                self._conns.pop(ident, None)
                self._pending.pop(ident, None)
                self._heard.discard(ident)
                name = self._tenant_of.pop(ident, None)
                if name is not None:
                    self._per_tenant[name] -= 1
                self._threads.discard(me)

    def _authenticated(self, tenant: Tenant) -> RequestError | None:
        """The calling connection's handshake authenticated ``tenant``: no longer pending."""
        ident = threading.get_ident()
        cap = self.config.effective_tenant_data_connections
        with self._lock:
            self._pending.pop(ident, None)
            held = self._per_tenant.get(tenant.name, 0)
            if held >= cap:
                return over_limit(
                    f"tenant {tenant.name!r} holds {held} data-plane connections, the most one "
                    "tenant may"
                )
            self._per_tenant[tenant.name] = held + 1
            self._tenant_of[ident] = tenant.name
        return None

    # -- stopping --------------------------------------------------------------------

    def stop(self, grace: float) -> bool:
        """Stop accepting, close idle connections, let requests in flight finish.

        Args:
            grace: Seconds requests in flight may take; then their connections are cut.

        Returns:
            Whether every connection ended within ``grace``.
        """
        with self._lock:
            if self._stopping:
                return True
            self._stopping = True
        os.write(self._wake_w, b"x")  # never read: every poller waiting on it wakes
        if self._accepting is not None:
            self._accepting.join(timeout=5)
        if self._listener is not None:
            self._listener.close()
        deadline = time.monotonic() + grace
        clean = self._join(deadline)
        if not clean:
            log.warning("data plane: requests still running after %.1f s; cutting them", grace)
            with self._lock:
                socks = list(self._conns.values())
            for s in socks:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    continue
            if not self._join(time.monotonic() + 5):
                return False  # NOTE: the wake pipe stays open while a thread may still poll it
        os.close(self._wake_w)
        os.close(self._wake_r)
        return clean

    def _join(self, deadline: float) -> bool:
        while True:
            with self._lock:
                threads = list(self._threads)
            if not threads:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            threads[0].join(timeout=left)
