"""The bulk data plane on the server: round trips, tenants, roles, limits, metrics, draining,
and a client killed mid-put."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from kvtier.wire import dataplane as wire
from kvtier.wire import kvtier_cache_pb2 as pb
from tests.server.helpers import (
    TOKENS,
    block,
    key,
    metric,
    remote,
    requests_of,
    running_server,
    server_config,
    sized_block,
    stub,
    tenants,
    wait_until,
)
from tests.server.rawdp import RawConn, put_request

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED.value[0]
DENIED = grpc.StatusCode.PERMISSION_DENIED.value[0]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


@pytest.fixture(scope="module")
def closed_server():
    cfg = server_config(
        open=False,
        http_port=None,
        tenants=tenants({"alpha": "writer", "beta": "writer", "ops": "reader"}),
        max_keys_per_call=64,
        max_block_size=40 * MiB,
        max_inflight_put_bytes=80 * MiB,
    )
    with running_server(cfg) as server:
        yield server


def test_health_advertises_the_data_plane(closed_server) -> None:
    assert closed_server.data_port and closed_server.data_port != closed_server.port
    channel, s = stub(closed_server.address)
    health = s.Health(pb.HealthRequest(), timeout=5)
    assert health.data_port == closed_server.data_port
    assert health.data_protocol_version == wire.DATA_PROTOCOL_VERSION
    channel.close()


@pytest.mark.parametrize("size", [4096, 256 * 1024, 4 * MiB, 32 * MiB])
def test_blocks_round_trip_over_the_data_plane(closed_server, size: int) -> None:
    tier = remote(closed_server, token=TOKENS["alpha"])
    items = [(key(size + i), sized_block(size + i, size)) for i in range(2)]
    missing = key(size + 99)
    assert tier.put(items) == [True, True]
    assert tier.get([items[0][0], missing, items[1][0]]) == [items[0][1], None, items[1][1]]
    t = tier.transport()
    assert (t.data_puts, t.data_gets, t.grpc_puts, t.grpc_gets, t.fallbacks) == (1, 1, 0, 0, 0)
    # what the data plane stored is what gRPC serves, and the other way round
    grpc_tier = remote(closed_server, token=TOKENS["alpha"], data_plane=False)
    assert grpc_tier.get([k for k, _ in items]) == [b for _, b in items]
    other = [(key(size + 50), sized_block(size + 50, size))]
    assert grpc_tier.put(other) == [True]
    assert tier.get([other[0][0]]) == [other[0][1]]
    assert grpc_tier.transport().data_gets == 0
    tier.delete([k for k, _ in items + other])
    tier.close()
    grpc_tier.close()


def test_the_data_plane_is_counted_like_grpc_calls(closed_server) -> None:
    s = closed_server
    tier = remote(s, token=TOKENS["beta"])
    b = block(7, tokens=500)
    bytes_in = metric(s, "kvtier_server_block_bytes_total", tenant="beta", direction="in")
    bytes_out = metric(s, "kvtier_server_block_bytes_total", tenant="beta", direction="out")
    gets = metric(s, "kvtier_server_requests_total", tenant="beta", method="data.Get", code="OK")
    hits = metric(s, "kvtier_server_keys_total", tenant="beta", op="get", kind="hit")
    assert tier.put([(key(7), b)]) == [True]
    assert tier.get([key(7), key(8)]) == [b, None]
    wait_until(
        lambda: (
            metric(s, "kvtier_server_requests_total", tenant="beta", method="data.Get", code="OK")
            == gets + 1
        ),
        "data.Get counted",
    )
    assert metric(s, "kvtier_server_block_bytes_total", tenant="beta", direction="in") == (
        bytes_in + len(b)
    )
    assert metric(s, "kvtier_server_block_bytes_total", tenant="beta", direction="out") == (
        bytes_out + len(b)
    )
    assert metric(s, "kvtier_server_keys_total", tenant="beta", op="get", kind="hit") == hits + 1
    assert requests_of(s, "data.Put") >= 1 and requests_of(s, "data.Connect") >= 1
    assert metric(s, "kvtier_server_data_connections") >= 1  # the tier keeps its connection
    assert metric(s, "kvtier_server_request_seconds_count", method="data.Get") >= 1
    tier.close()


def test_tenants_cannot_read_detect_or_delete_each_others_blocks(closed_server) -> None:
    s = closed_server
    a = remote(s, token=TOKENS["alpha"])
    b = remote(s, token=TOKENS["beta"])
    k = key(1200)
    block_a, block_b = block(1, bound=k), block(2, bound=k)
    assert a.put([(k, block_a)]) == [True]
    assert b.get([k]) == [None]  # over the data plane
    assert b.contains([k]) == [False] and b.prefix_length([k]) == 0
    assert b.delete([k]) == 0
    assert a.get([k]) == [block_a]
    assert b.put([(k, block_b)]) == [True]  # beta's own block under the same key
    assert (a.get([k]), b.get([k])) == ([block_a], [block_b])
    assert a.delete([k]) == 1
    assert (a.get([k]), b.get([k])) == ([None], [block_b])
    assert a.transport().data_gets >= 3 and b.transport().data_gets >= 2
    # and on the wire, with no client code: beta's connection sees nothing of alpha's
    assert a.put([(k, block_a)]) == [True]
    with RawConn(s.data_port) as conn:
        assert conn.hello(TOKENS["beta"]).ok
        assert conn.get([k]) == [block_b]
    b.delete([k])
    with RawConn(s.data_port) as conn:
        assert conn.hello(TOKENS["beta"]).ok
        assert conn.get([k]) == [None]
    a.delete([k])
    a.close()
    b.close()


@pytest.mark.parametrize(
    "token", [None, "wrong-token", "x" * 3000], ids=["no-token", "unknown", "long-unknown"]
)
def test_unauthenticated_connections_are_refused_and_closed(closed_server, token) -> None:
    before = metric(closed_server, "kvtier_server_rejected_total", reason="unauthenticated")
    with RawConn(closed_server.data_port) as conn:
        status = conn.hello(token)
        assert status.code == UNAUTHENTICATED and status.message
        assert conn.closed_by_server()
    assert (
        metric(closed_server, "kvtier_server_rejected_total", reason="unauthenticated")
        == before + 1
    )


def test_roles_apply_to_the_data_plane(closed_server) -> None:
    k = key(13)
    writer = remote(closed_server, token=TOKENS["alpha"])
    writer.put([(k, block(13))])
    with RawConn(closed_server.data_port) as conn:
        assert conn.hello(TOKENS["ops"]).ok  # a reader may connect and get
        assert conn.get([k]) == [None]  # (its own namespace)
        status, _ = conn.put([(k, block(13))])
        assert status.code == DENIED and "reader" in status.message
        assert conn.closed_by_server()
    reader = remote(closed_server, token=TOKENS["ops"], skip_existing=False)
    assert reader.put([(k, block(13))]) == [False]  # a read-only token sends no put at all
    sent = reader.transport()
    assert (sent.data_puts, sent.grpc_puts) == (0, 0)
    writer.delete([k])
    writer.close()
    reader.close()


def test_limits_are_checked_before_the_payload(closed_server) -> None:
    # a block over max_block_size is refused from its header alone: nothing else was sent
    with RawConn(closed_server.data_port) as conn:
        assert conn.hello(TOKENS["alpha"]).ok
        conn.send(wire.REQUEST.pack(wire.OP_PUT, 1) + wire.PUT_ITEM.pack(key(1), 41 * MiB))
        status = conn.read_status()
        assert status.code == EXHAUSTED and "at most" in status.message
        assert conn.closed_by_server()
    # too many keys: refused from the request header, before any key
    with RawConn(closed_server.data_port) as conn:
        assert conn.hello(TOKENS["alpha"]).ok
        conn.send(wire.REQUEST.pack(wire.OP_GET, 65))
        assert conn.read_status().code == EXHAUSTED
        assert conn.closed_by_server()
    # the put budget is shared with gRPC: a block that does not fit now is refused
    assert closed_server.service.put_budget.try_reserve(60 * MiB)
    try:
        with RawConn(closed_server.data_port) as conn:
            assert conn.hello(TOKENS["alpha"]).ok
            conn.send(wire.REQUEST.pack(wire.OP_PUT, 1) + wire.PUT_ITEM.pack(key(2), 30 * MiB))
            status = conn.read_status()
            assert status.code == EXHAUSTED and "retry later" in status.message
    finally:
        closed_server.service.put_budget.release(60 * MiB)
    assert closed_server.service.put_budget.used == 0


def test_a_refused_put_keeps_the_blocks_before_it(closed_server) -> None:
    good, bad = block(21, tokens=300), bytearray(block(22, tokens=300))
    bad[100] ^= 0xFF
    with RawConn(closed_server.data_port) as conn:
        assert conn.hello(TOKENS["alpha"]).ok
        status, _ = conn.put([(key(21), good), (key(22), bytes(bad)), (key(23), block(23))])
        assert status.code == INVALID and "not a valid kvtier block" in status.message
    tier = remote(closed_server, token=TOKENS["alpha"])
    assert tier.get([key(21), key(22), key(23)]) == [good, None, None]
    tier.delete([key(21)])
    tier.close()
    assert closed_server.service.put_budget.used == 0


def test_a_connection_serves_many_requests(closed_server) -> None:
    with RawConn(closed_server.data_port) as conn:
        assert conn.hello(TOKENS["alpha"]).ok
        for i in range(5):
            items = [(key(1400 + i), block(1400 + i, tokens=20 + i))]
            status, stored = conn.put(items)
            assert status.ok and stored == 1
            assert conn.get([items[0][0], key(1)]) == [items[0][1], None]
        assert conn.get([]) == []
        status, stored = conn.put([])
        assert status.ok and stored == 0


def test_the_data_plane_can_be_off() -> None:
    with running_server(server_config(http_port=None, data_port=None)) as server:
        assert server.data_port is None
        tier = remote(server)
        assert tier.health().data_port == 0
        assert tier.put([(key(1), block(1))]) == [True]
        assert tier.get([key(1)]) == [block(1)]
        t = tier.transport()
        assert (t.data_gets, t.grpc_gets, t.grpc_puts, t.fallbacks) == (0, 1, 1, 0)
        tier.close()


def test_draining_finishes_a_put_in_flight_and_refuses_new_requests() -> None:
    with running_server(server_config(http_port=None)) as server:
        data = block(31, tokens=4000)
        busy, idle = RawConn(server.data_port), RawConn(server.data_port)
        assert busy.hello(None).ok and idle.hello(None).ok
        request = put_request([(key(31), data)])
        half = len(request) // 2
        busy.send(request[:half])
        wait_until(lambda: server.service.put_budget.used > 0, "the server holds half a block")
        stopper = threading.Thread(target=server.stop, kwargs={"grace": 20})
        stopper.start()
        wait_until(lambda: server.service.draining, "draining")
        busy.send(request[half:])
        status = busy.read_status()
        assert status.ok, status
        assert wire.PUT_DONE.unpack(busy.read_exact(wire.PUT_DONE.size))[0] == 1
        stopper.join(timeout=30)
        assert not stopper.is_alive()
        assert busy.closed_by_server()
        assert idle.closed_by_server()  # the idle connection was closed by the stop
        busy.close()
        idle.close()
        assert metric(server, "kvtier_server_block_bytes_total", tenant="anonymous", direction="in")
        assert metric(server, "kvtier_server_data_connections") == 0


def test_a_request_on_a_draining_server_is_unavailable() -> None:
    with running_server(server_config(http_port=None)) as server:
        conn = RawConn(server.data_port)
        assert conn.hello(None).ok
        server.service.drain()
        result = conn.get([key(1)])
        assert isinstance(result, wire.Status) and result.code == UNAVAILABLE
        conn.close()


_KILLED_CLIENT = """
import socket, struct, sys, time
from kvtier.wire import dataplane as wire
port, key, data = int(sys.argv[1]), bytes.fromhex(sys.argv[2]), open(sys.argv[3], "rb").read()
s = socket.create_connection(("127.0.0.1", port))
s.sendall(wire.hello(None))
s.recv(64)
s.sendall(wire.REQUEST.pack(wire.OP_PUT, 1) + wire.PUT_ITEM.pack(key, len(data)) + data[: len(data) // 2])
print("half", flush=True)
time.sleep(60)
"""


def test_a_client_killed_mid_put_leaves_no_block(tmp_path: Path) -> None:
    with running_server(server_config(http_port=None)) as server:
        k, data = key(77), block(77, 4000)
        (tmp_path / "block").write_bytes(data)
        before = metric(server, "kvtier_server_incomplete_puts_total")
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _KILLED_CLIENT,
                str(server.data_port),
                k.hex(),
                str(tmp_path / "block"),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "half"
            wait_until(lambda: server.service.put_budget.used > 0, "the server holds half a block")
        finally:
            child.kill()
            child.wait()
        wait_until(
            lambda: metric(server, "kvtier_server_incomplete_puts_total") == before + 1,
            "the server noticed the dead client",
        )
        tier = remote(server)
        assert tier.contains([k]) == [False]
        assert tier.get([k]) == [None]
        assert server.service.put_budget.used == 0
        assert tier.put([(k, data)]) == [True]  # still serving
        assert tier.get([k]) == [data]
        tier.close()
