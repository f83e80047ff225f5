"""Noisy neighbours: one tenant (or nobody at all) cannot stop another tenant's calls.

Each probe is what an attacker with a writer token, or with no token, did to
``kvtier serve`` (issue 19); after each, tenant ``alpha``'s Lookup and Put
must still answer within their own deadline (a generous one: the machine
may be busy), and the server must have taken back what the attacker held.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from kvtier.server.app import CacheServer
from kvtier.server.dataplane import DataPlaneServer
from kvtier.wire import dataplane as wire
from kvtier.wire import kvtier_cache_pb2 as pb
from tests.server.helpers import (
    TOKENS,
    auth,
    block,
    key,
    metric,
    remote,
    running_server,
    server_config,
    sized_block,
    stub,
    tenants,
    wait_until,
)

MiB = 1 << 20
DEADLINE_S = 20.0
"""The deadline of alpha's calls: generous, so a loaded 2-core machine passes; a starved
server misses any deadline."""


def _alpha_answers(server: CacheServer, i: int) -> None:
    """alpha's Lookup and Put (and a Get of what it put) succeed within their deadline."""
    channel, s = stub(server.address)
    md = auth(TOKENS["alpha"])
    try:
        k = key(i)
        data = block(i)
        frames = [pb.PutFrame(key=k, size=len(data), data=data)]
        resp = s.Put(iter([pb.PutBatch(frames=frames)]), metadata=md, timeout=DEADLINE_S)
        assert resp.blocks == 1
        assert s.Lookup(pb.KeysRequest(keys=[k]), metadata=md, timeout=DEADLINE_S).prefix_length
    finally:
        channel.close()
    tier = remote(server, TOKENS["alpha"], timeout_s=DEADLINE_S, retries=0)
    try:
        assert tier.get([key(i)]) == [block(i)]
        assert tier.put([(key(i + 1), block(i + 1))]) == [True]
    finally:
        tier.close()


def _stalled_put(size: int, release: threading.Event, drip_s: float = 0.0) -> Iterator[pb.PutBatch]:
    """A Put stream that declares a block of ``size`` bytes, sends 1 KiB of it, then stalls.

    With ``drip_s`` it sends one more byte every ``drip_s`` (so no idle
    deadline ends it) until ``release``; then the stream ends inside its block.
    """
    yield pb.PutBatch(frames=[pb.PutFrame(key=key(99), size=size, data=b"\0" * 1024)])
    sent = 1024
    while not release.wait(drip_s if drip_s else 120) and sent < size - 1:
        yield pb.PutBatch(frames=[pb.PutFrame(data=b"\0")])
        sent += 1


def _read_to_close(sock: socket.socket) -> None:
    """Read until the server closes ``sock`` (fails if it never does within a minute)."""
    sock.settimeout(60)
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass


@pytest.fixture
def limited() -> Iterator[CacheServer]:
    cfg = server_config(
        open=False,
        tenants=tenants({"alpha": "writer", "beta": "writer", "ops": "admin"}),
        threads=8,  # tenant_max_calls: 4 by default
        max_block_size=MiB,
        max_inflight_put_bytes=4 * MiB,  # tenant_max_inflight_put_bytes: 1 MiB by default
        stream_idle_timeout_s=1.0,
        data_io_timeout_s=1.0,
        data_handshake_timeout_s=1.0,
        data_max_connections=32,  # fewer than the silent sockets below
        http_timeout_s=1.0,
        http_max_threads=4,
    )
    with running_server(cfg) as server:
        yield server


def test_sixteen_stalled_put_streams_of_one_tenant_leave_another_answering(limited) -> None:
    server = limited
    channel, s = stub(server.address)
    release = threading.Event()
    md = auth(TOKENS["beta"])
    calls = [
        s.Put.future(_stalled_put(64 * 1024, release, 0.2), metadata=md, timeout=120)
        for _ in range(16)
    ]
    try:
        wait_until(lambda: sum(c.done() for c in calls) >= 12, "refusals beyond beta's share", 30)
        _alpha_answers(server, 1000)  # while beta holds 4 of the 8 threads
    finally:
        release.set()
        codes = []
        for call in calls:
            with pytest.raises(grpc.RpcError) as e:
                call.result()
            codes.append(e.value.code())
        channel.close()
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 12  # refused at once
    wait_until(lambda: server.gate.put_budget.used == 0, "budget released", 30)


def test_stalled_streams_declaring_big_blocks_cannot_take_the_shared_byte_budget(limited) -> None:
    server = limited
    channel, s = stub(server.address)
    release = threading.Event()
    md = auth(TOKENS["beta"])
    calls = [
        s.Put.future(_stalled_put(MiB, release, 0.2), metadata=md, timeout=120) for _ in range(4)
    ]
    try:
        wait_until(lambda: sum(c.done() for c in calls) >= 3, "refusals beyond beta's bytes", 30)
        assert server.gate.put_budget.used <= MiB  # beta's share, not the server's 4 MiB
        k = key(2000)
        big = sized_block(2000, MiB - 4096)
        tier = remote(server, TOKENS["alpha"], timeout_s=DEADLINE_S, retries=0)
        try:
            assert tier.put([(k, big)]) == [True]
            assert tier.get([k]) == [big]
        finally:
            tier.close()
        _alpha_answers(server, 2001)
    finally:
        release.set()
        for call in calls:
            with pytest.raises(grpc.RpcError):
                call.result()
    # a stream that stops altogether is cancelled at its idle deadline, its bytes given back
    stalled = s.Put.future(_stalled_put(MiB, threading.Event()), metadata=md, timeout=120)
    with pytest.raises(grpc.RpcError) as e:
        stalled.result()
    assert e.value.code() == grpc.StatusCode.CANCELLED
    assert metric(server, "kvtier_server_cancelled_calls_total", reason="idle") == 1
    wait_until(lambda: server.gate.put_budget.used == 0, "budget released", 30)
    channel.close()


def test_silent_and_stalled_data_plane_sockets_leave_a_tenant_its_data_plane(limited) -> None:
    server = limited
    assert server.data_port
    silent = [socket.create_connection(("127.0.0.1", server.data_port)) for _ in range(100)]
    stalled = socket.create_connection(("127.0.0.1", server.data_port))
    try:
        # an authenticated tenant declares a 1 MiB PUT and sends nothing more
        token = TOKENS["beta"].encode()
        stalled.sendall(wire.HELLO.pack(wire.MAGIC, wire.DATA_PROTOCOL_VERSION, len(token)) + token)
        stalled.sendall(wire.REQUEST.pack(wire.OP_PUT, 1) + wire.PUT_ITEM.pack(key(7), MiB))
        tier = remote(server, TOKENS["alpha"], timeout_s=DEADLINE_S, retries=0)
        try:
            assert tier.put([(key(3000), block(3000))]) == [True]
            assert tier.get([key(3000)]) == [block(3000)]
            counts = tier.transport()
            assert (counts.data_puts, counts.data_gets, counts.fallbacks) == (1, 1, 0)
        finally:
            tier.close()
        _alpha_answers(server, 3001)
        # the server closed every silent socket (evicted, or at its handshake deadline) and the
        # stalled PUT at its idle deadline, giving back its reservation
        for sock in [*silent, stalled]:
            _read_to_close(sock)
        wait_until(lambda: server.gate.put_budget.used == 0, "budget released", 30)
        assert metric(server, "kvtier_server_cancelled_calls_total", reason="idle") >= 1
    finally:
        for sock in [*silent, stalled]:
            sock.close()


def test_half_sent_http_requests_neither_pile_up_threads_nor_hold_them(limited) -> None:
    server = limited
    before = threading.active_count()
    half = []
    for _ in range(100):
        sock = socket.create_connection(("127.0.0.1", server.http_port))
        sock.sendall(b"GET /api/stats HTTP/1.1\r\nHost: x\r\n")  # never finished
        half.append(sock)
    try:
        time.sleep(0.2)  # let the server accept what it will
        assert threading.active_count() <= before + 4  # http_max_threads
        _alpha_answers(server, 4000)
        for sock in half:  # every one is closed by the server (at once, or at its timeout)
            _read_to_close(sock)
        with urllib.request.urlopen(
            f"http://127.0.0.1:{server.http_port}/healthz", timeout=30
        ) as r:
            assert r.status == 200
    finally:
        for sock in half:
            sock.close()


def test_many_handshakes_from_one_address_waiting_for_a_core_are_all_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine opens one data-plane connection per concurrent load or save, all from one
    address; on a busy host their handshakes arrive before the server's threads read them.
    Those connections are not silent: beyond ``data_max_pending_per_address`` only silent
    ones are closed (at 32 clients of ``bench/tier_load.py`` the oldest talking ones were,
    and their puts fell back to gRPC and failed)."""
    starved = threading.Event()
    real = DataPlaneServer._await_first_bytes

    def after_a_core(self: DataPlaneServer, conn: socket.socket, timeout: float) -> bool:
        starved.wait(30)  # the connection's thread gets no core until the test says so
        return real(self, conn, timeout)

    monkeypatch.setattr(DataPlaneServer, "_await_first_bytes", after_a_core)
    cfg = server_config(
        open=False,
        tenants=tenants(),
        data_max_pending_per_address=4,
        data_handshake_timeout_s=10.0,
    )
    token = TOKENS["alpha"].encode()
    hello = wire.HELLO.pack(wire.MAGIC, wire.DATA_PROTOCOL_VERSION, len(token)) + token
    with running_server(cfg) as server:
        assert server.data_port
        data_plane = server._data
        silent, talking = [], []
        try:
            for _ in range(6):
                silent.append(socket.create_connection(("127.0.0.1", server.data_port)))
            for _ in range(12):
                sock = socket.create_connection(("127.0.0.1", server.data_port))
                sock.sendall(hello)
                talking.append(sock)
            wait_until(lambda: len(data_plane._threads) == 18, "every connection accepted", 30)
            starved.set()
            reply = wire.HELLO_REPLY.size + wire.STATUS.size
            for sock in talking:
                sock.settimeout(30)
                got = b""
                while len(got) < reply:
                    chunk = sock.recv(reply - len(got))
                    assert chunk, "a talking connection was closed before its reply"
                    got += chunk
                code, _ = wire.STATUS.unpack_from(got, wire.HELLO_REPLY.size)
                assert code == 0
            for sock in silent:  # every silent one was closed to make room
                _read_to_close(sock)
            assert metric(server, "kvtier_server_rejected_total", reason="limit") == 6
        finally:
            starved.set()
            for sock in [*silent, *talking]:
                sock.close()
