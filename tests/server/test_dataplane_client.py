"""The remote tier's data-plane client: fallback to gRPC, stalled servers (timeouts, retries,
breaker), connections closed by the server, TLS."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from kvtier.errors import TierUnavailableError
from kvtier.metrics import StoreMetrics
from kvtier.server_config import TlsConfig
from kvtier.tiers.remote_errors import RemoteProtocolError, RemoteRetryableError
from kvtier.wire import dataplane as wire
from tests.server.helpers import (
    block,
    free_port,
    key,
    metric,
    remote,
    requests_of,
    running_server,
    server_config,
    wait_until,
)
from tests.server.test_remote_tier import _self_signed


class StalledDataPlane:
    """A TCP server that accepts and then never answers (``handshake=True``: it answers the
    handshake, then never a request). Counts connections and request bytes it got."""

    def __init__(self, handshake: bool) -> None:
        self.handshake = handshake
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.requests = 0
        self._socks: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.listener.settimeout(0.05)
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            self._socks.append(conn)
            if self.handshake:
                conn.settimeout(5)
                head = conn.recv(wire.HELLO.size, socket.MSG_WAITALL)
                _, _, n = wire.HELLO.unpack(head)
                if n:
                    conn.recv(n, socket.MSG_WAITALL)
                conn.sendall(wire.hello_reply(wire.OK))
                threading.Thread(target=self._count_requests, args=(conn,), daemon=True).start()

    def _count_requests(self, conn: socket.socket) -> None:
        try:
            if conn.recv(wire.REQUEST.size, socket.MSG_WAITALL):
                self.requests += 1
        except OSError:
            return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.listener.close()
        for s in self._socks:
            s.close()


def test_a_dead_data_port_falls_back_to_grpc_and_is_counted() -> None:
    with running_server(server_config(http_port=None)) as server:
        metrics = StoreMetrics()
        tier = remote(
            server, data_address=f"127.0.0.1:{free_port()}", breaker_reset_s=60, metrics=metrics
        )
        assert tier.put([(key(1), block(1))]) == [True]
        assert tier.get([key(1), key(2)]) == [block(1), None]
        assert (
            metrics.value(
                "kvtier_tier_errors_total", {"tier": tier.name, "kind": "data_plane_fallback"}
            )
            == 1
        )
        t = tier.transport()
        # the first attempt found no data plane and went over gRPC; later calls skip it (cool-down)
        assert (t.fallbacks, t.data_puts, t.data_gets, t.grpc_puts, t.grpc_gets) == (1, 0, 0, 1, 1)
        assert requests_of(server, "Put") == 1 and requests_of(server, "data.Put") == 0
        assert tier.breaker.state.value == "closed"  # the server is fine: no failure counted
        tier.close()


def test_a_stalled_handshake_falls_back_to_grpc_within_the_connect_timeout() -> None:
    stalled = StalledDataPlane(handshake=False)
    try:
        with running_server(server_config(http_port=None)) as server:
            tier = remote(server, data_address=f"127.0.0.1:{stalled.port}", timeout_s=0.3)
            assert tier.put([(key(3), block(3))]) == [True]
            assert tier.get([key(3)]) == [block(3)]
            t = tier.transport()
            assert t.fallbacks == 1 and t.grpc_puts == 1 and t.data_gets == 0
            assert stalled.connections == 1
            tier.close()
    finally:
        stalled.close()


def test_a_stalled_data_plane_times_out_is_retried_and_opens_the_breaker() -> None:
    stalled = StalledDataPlane(handshake=True)
    try:
        with running_server(server_config(http_port=None)) as server:
            tier = remote(
                server,
                data_address=f"127.0.0.1:{stalled.port}",
                transfer_timeout_s=0.3,
                retries=1,
                retry_backoff_s=0.01,
                breaker_failures=2,
                breaker_reset_s=60,
            )
            for _ in range(2):
                with pytest.raises(RemoteRetryableError, match="data-plane get") as e:
                    tier.get([key(1)])
                assert "could not send" in str(e.value) or "no data" in str(e.value)
            # two logical calls of two attempts each, each on its own connection
            assert stalled.connections == 4
            wait_until(lambda: stalled.requests == 4, "the stalled server got every request")
            assert tier.breaker.state.value == "open"
            with pytest.raises(TierUnavailableError, match="circuit breaker open"):
                tier.get([key(1)])
            assert stalled.connections == 4  # an open breaker touches nothing
            assert tier.transport().fallbacks == 0  # connected fine: not a reason for gRPC
            tier.close()
    finally:
        stalled.close()


def test_connections_the_server_closed_while_idle_are_replaced() -> None:
    with running_server(server_config(http_port=None, data_idle_timeout_s=0.2)) as server:
        tier = remote(server, retries=0)
        assert tier.put([(key(5), block(5))]) == [True]
        assert tier.transport().connects == 1
        wait_until(
            lambda: metric(server, "kvtier_server_data_connections") == 0,
            "the server closed the idle connection",
        )
        assert tier.get([key(5)]) == [block(5)]  # no error although the pooled one was dead
        t = tier.transport()
        assert (t.connects, t.data_gets, t.fallbacks) == (2, 1, 0)
        tier.close()


def test_concurrent_callers_each_get_a_connection_and_reuse_it() -> None:
    with running_server(server_config(http_port=None)) as server:
        tier = remote(server, data_connections=4)
        items = [(key(600 + i), block(600 + i, tokens=200)) for i in range(8)]
        tier.put(items)
        errors: list[str] = []
        start = threading.Barrier(4)

        def caller(n: int) -> None:
            start.wait(timeout=10)
            for _ in range(10):
                got = tier.get([k for k, _ in items])
                if got != [b for _, b in items]:
                    errors.append(f"caller {n}: wrong blocks")

        threads = [threading.Thread(target=caller, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors
        t = tier.transport()
        assert t.data_gets == 40 and 1 <= t.connects <= 5  # at most one per concurrent caller
        tier.close()


def test_a_key_of_the_wrong_size_is_refused_before_sending() -> None:
    with running_server(server_config(http_port=None)) as server:
        tier = remote(server)
        tier.limits()
        with pytest.raises(RemoteProtocolError, match="key #1 is 15 bytes"):
            tier.get([key(1), key(2)[:15]])
        assert requests_of(server, "data.Get") == 0
        tier.close()


def test_tls_covers_the_data_plane(tmp_path: Path) -> None:
    files = _self_signed(tmp_path)
    if files is None:
        pytest.skip("needs the openssl command to make a self-signed certificate")
    cert, key_file = files
    cfg = server_config(http_port=None, tls=TlsConfig(cert_file=cert, key_file=key_file))
    with running_server(cfg) as server:
        tier = remote(server, ca_file=cert)
        big = block(9, tokens=20_000)
        assert tier.put([(key(1), block(1)), (key(9), big)]) == [True, True]
        assert tier.get([key(1), key(9), key(2)]) == [block(1), big, None]
        t = tier.transport()
        assert (t.data_puts, t.data_gets, t.fallbacks) == (1, 1, 0)
        tier.close()
        # a plaintext connection to the TLS data port gets nowhere (closed, no kvtier answer)
        with socket.create_connection(("127.0.0.1", server.data_port), timeout=10) as s:
            s.sendall(wire.hello(None))
            try:
                reply = s.recv(64)
            except ConnectionResetError:
                reply = b""
            assert not reply.startswith(wire.MAGIC)
        again = remote(server, ca_file=cert)
        assert again.get([key(9)]) == [big] and again.transport().data_gets == 1
        again.close()


def test_a_server_restarted_on_another_data_port_is_found_again() -> None:
    port = free_port()
    tier = remote(f"127.0.0.1:{port}", retries=0, timeout_s=1, breaker_failures=100)
    with running_server(server_config(port=port, data_port=free_port(), http_port=None)) as first:
        assert tier.put([(key(1), block(1))]) == [True]
        old_data_port = first.data_port
    new_data_port = free_port()
    assert new_data_port != old_data_port
    with running_server(server_config(port=port, data_port=new_data_port, http_port=None)):

        def grpc_back() -> bool:
            try:
                return tier.contains([key(1)]) == [False]  # a new, empty process
            except RemoteRetryableError:
                return False

        wait_until(grpc_back, "the gRPC channel reconnected")
        # the pooled connection is dead and the old port refuses: this call goes over gRPC
        assert tier.put([(key(2), block(2))]) == [True]
        assert tier.transport().fallbacks == 1
        # the next call learns the new port from Health and uses it at once (no cool-down)
        assert tier.get([key(2)]) == [block(2)]
        t = tier.transport()
        assert (t.fallbacks, t.data_gets, t.grpc_gets) == (1, 1, 0)
        assert tier.describe()["data_plane"] == f"127.0.0.1:{new_data_port}"
    tier.close()


def test_a_put_refused_mid_send_reports_the_servers_reason() -> None:
    cfg = server_config(http_port=None, max_block_size=16 << 20, max_inflight_put_bytes=32 << 20)
    with running_server(cfg) as server:
        tier = remote(server, retries=0, skip_existing=False)
        big = block(40, tokens=60_000)  # ~7.5 MiB: still being sent when the refusal comes
        assert server.service.put_budget.try_reserve(30 << 20)  # other puts hold the budget
        try:
            with pytest.raises(RemoteRetryableError, match=r"RESOURCE_EXHAUSTED.*retry later"):
                tier.put([(key(40), big)])
        finally:
            server.service.put_budget.release(30 << 20)
        assert tier.transport().fallbacks == 0
        assert tier.put([(key(40), big)]) == [True]  # room again: a fresh connection, stored
        assert tier.get([key(40)]) == [big]
        tier.close()


def test_a_full_data_plane_sends_callers_to_grpc() -> None:
    with running_server(server_config(http_port=None, data_max_connections=1)) as server:
        holder = socket.create_connection(("127.0.0.1", server.data_port), timeout=10)
        holder.sendall(wire.hello(None))
        assert holder.recv(64).startswith(wire.MAGIC)  # it holds the only connection
        tier = remote(server)
        assert tier.put([(key(50), block(50))]) == [True]
        t = tier.transport()
        assert (t.fallbacks, t.grpc_puts, t.data_puts) == (1, 1, 0)
        assert metric(server, "kvtier_server_rejected_total", reason="limit") == 1
        tier.close()
        holder.close()
