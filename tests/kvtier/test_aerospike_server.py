"""The protocol-level Aerospike test server, checked through the official client directly.

These pin the behaviours the tier tests rely on, so that a test-server bug
cannot make a tier test pass for the wrong reason.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import aerospike
import pytest
from aerospike import exception as ex
from aerospike_helpers.batch.records import BatchRecords, Read, Remove, Write
from aerospike_helpers.operations import operations as op

from tests.support.aerospike_server import AerospikeTestServer, NamespaceConfig
from tests.support.timeouts import scaled_ms

MiB = 1024 * 1024
pytestmark = pytest.mark.aerospike_emulator(
    "checks the emulator itself, through the official client"
)


@pytest.fixture
def server() -> Iterator[AerospikeTestServer]:
    with AerospikeTestServer([NamespaceConfig(), NamespaceConfig(name="test")]) as srv:
        yield srv


@pytest.fixture
def client(server: AerospikeTestServer) -> Iterator[Any]:
    policy = {"total_timeout": scaled_ms(1000), "max_retries": 0}
    c = aerospike.client(
        {
            "hosts": [(server.host, server.port)],
            "policies": {"read": policy, "write": policy, "batch": policy},
        }
    )
    yield c
    c.close()


def key(name: bytes, ns: str = "kvcache", set_name: str = "s") -> tuple[str, str, bytearray]:
    return (ns, set_name, bytearray(name))


def test_cluster_forms_and_answers_info(client: Any, server: AerospikeTestServer) -> None:
    assert client.is_connected()
    assert client.get_node_names()
    text = client.info_random_node("namespace/kvcache")
    fields = dict(p.split("=", 1) for p in text.split("\t", 1)[1].strip().split(";"))
    assert fields["max-record-size"] == str(MiB)
    assert fields["objects"] == "0"
    assert client.info_random_node("build").split("\t")[1].strip() == "8.1.2.0"
    assert "type=unknown" in client.info_random_node("namespace/nope")


def test_put_get_exists_remove_with_generation_and_ttl(client: Any) -> None:
    k = key(b"a")
    client.put(k, {"b": b"1"}, policy={"ttl": 100})
    _, meta, bins = client.get(k)
    assert bins == {"b": b"1"} and meta["gen"] == 1 and 98 <= meta["ttl"] <= 100
    client.put(k, {"c": b"2"}, policy={"ttl": aerospike.TTL_NEVER_EXPIRE})
    _, meta, bins = client.get(k)
    assert bins == {"b": b"1", "c": b"2"} and meta["gen"] == 2
    assert meta["ttl"] == aerospike.TTL_NEVER_EXPIRE
    assert client.exists(k)[1]["gen"] == 2
    assert client.exists(key(b"missing"))[1] is None
    with pytest.raises(ex.RecordGenerationError):
        client.remove(k, policy={"gen": aerospike.POLICY_GEN_EQ, "generation": 1})
    client.remove(k, policy={"gen": aerospike.POLICY_GEN_EQ, "generation": 2})
    with pytest.raises(ex.RecordNotFound):
        client.get(k)
    with pytest.raises(ex.RecordNotFound):
        client.remove(k)


def test_create_only_replace_and_touch(client: Any, server: AerospikeTestServer) -> None:
    k = key(b"c")
    client.put(k, {"x": b"1", "y": b"2"}, policy={"exists": aerospike.POLICY_EXISTS_CREATE})
    with pytest.raises(ex.RecordExistsError):
        client.put(k, {"x": b"3"}, policy={"exists": aerospike.POLICY_EXISTS_CREATE})
    client.put(k, {"x": b"4"}, policy={"exists": aerospike.POLICY_EXISTS_REPLACE})
    assert client.get(k)[2] == {"x": b"4"}
    with pytest.raises(ex.RecordNotFound):
        client.put(key(b"none"), {"x": b"1"}, policy={"exists": aerospike.POLICY_EXISTS_UPDATE})
    client.touch(k, 500)
    assert 498 <= client.get(k)[1]["ttl"] <= 500
    with pytest.raises(ex.RecordNotFound):
        client.touch(key(b"none"), 10)
    assert server.counts["touch"] == 2


def test_record_size_overhead_matches_the_real_server(client: Any) -> None:
    # Measured on CE 8.1.2.0: one bytes bin "b" in set "test", 1 MiB cap: 1,048,524 B fit.
    k = ("kvcache", "test", bytearray(b"big"))
    never = {"ttl": aerospike.TTL_NEVER_EXPIRE}
    client.put(k, {"b": b"z" * (MiB - 52)}, policy=never)
    with pytest.raises(ex.RecordTooBig):
        client.put(k, {"b": b"z" * (MiB - 51)}, policy=never)
    with pytest.raises(ex.RecordTooBig):
        client.put(k, {"b": b"z" * MiB}, policy=never)


def test_batch_rows_results_and_repeat(client: Any, server: AerospikeTestServer) -> None:
    keys = [key(bytes([i])) for i in range(6)]
    for k in keys[::2]:
        client.put(k, {"v": bytes(k[2])})
    server.reset_counts()
    res = client.batch_read(keys)
    assert [r.result for r in res.batch_records] == [0, 2, 0, 2, 0, 2]
    assert [r.record[2]["v"] for r in res.batch_records if r.result == 0] == [
        b"\x00",
        b"\x02",
        b"\x04",
    ]
    assert server.counts["batch"] == 1 and server.counts["batch_rows"] == 6
    assert server.counts["batch_repeat_rows"] == 5  # same namespace, set and bins: REPEAT rows
    exists = client.batch_read(keys, [])
    assert [len(r.record) if r.result == 0 else None for r in exists.batch_records] == [2, None] * 3
    assert all(r.record[1]["gen"] == 1 for r in exists.batch_records if r.result == 0)
    mixed = client.batch_write(
        BatchRecords(
            [
                Write(
                    keys[1],
                    [op.write("v", b"new")],
                    policy={"exists": aerospike.POLICY_EXISTS_CREATE},
                ),
                Write(
                    keys[0],
                    [op.write("v", b"dup")],
                    policy={"exists": aerospike.POLICY_EXISTS_CREATE},
                ),
                Read(keys[2], [op.read("v")]),
                Remove(keys[4]),
                Remove(keys[5]),
            ]
        )
    )
    assert [r.result for r in mixed.batch_records] == [0, 5, 0, 0, 2]
    assert mixed.batch_records[2].record[2] == {"v": b"\x02"}
    assert client.get(keys[1])[2] == {"v": b"new"}
    assert client.exists(keys[4])[1] is None


def test_large_batches_span_several_messages(client: Any) -> None:
    keys = [key(b"L%d" % i) for i in range(8)]
    value = b"q" * (300 * 1024)
    client.batch_write(BatchRecords([Write(k, [op.write("v", value)]) for k in keys]))
    res = client.batch_read(keys)
    assert all(r.result == 0 and r.record[2]["v"] == value for r in res.batch_records)


def test_records_expire_and_read_touch_extends_them(
    client: Any, server: AerospikeTestServer
) -> None:
    a, b = key(b"ta"), key(b"tb")
    client.put(a, {"v": b"1"}, policy={"ttl": 100})
    client.put(b, {"v": b"1"}, policy={"ttl": 100})
    # 60%: a read within the last 60 s of the record's 100 s life touches it.
    server.advance_clock(30)
    client.get(a, policy={"read_touch_ttl_percent": 60})  # 70 s left: no touch
    assert server.counts["read_touch"] == 0
    server.advance_clock(20)
    client.get(a, policy={"read_touch_ttl_percent": 60})  # 50 s left: touch
    client.get(b, policy={"read_touch_ttl_percent": -1})  # never touch
    assert server.counts["read_touch"] == 1
    server.advance_clock(60)
    assert client.get(a)[2] == {"v": b"1"}
    with pytest.raises(ex.RecordNotFound):
        client.get(b)


def test_ttl_writes_need_nsup() -> None:
    with AerospikeTestServer([NamespaceConfig(nsup_period=0)]) as srv:
        c = aerospike.client({"hosts": [(srv.host, srv.port)]})
        with pytest.raises(ex.ForbiddenError):
            c.put(key(b"x"), {"v": b"1"}, policy={"ttl": 10})
        c.put(key(b"x"), {"v": b"1"}, policy={"ttl": aerospike.TTL_NEVER_EXPIRE})
        c.close()


def test_stop_writes_allows_reads_and_deletes(client: Any, server: AerospikeTestServer) -> None:
    k = key(b"sw")
    client.put(k, {"v": b"1"})
    server.stop_writes = True
    with pytest.raises(ex.ServerFull):
        client.put(key(b"sw2"), {"v": b"1"})
    assert client.get(k)[2] == {"v": b"1"}
    client.remove(k)


def test_faults_latency_errors_and_drops(client: Any, server: AerospikeTestServer) -> None:
    k = key(b"f")
    client.put(k, {"v": b"1"})
    server.fail_next(18)
    with pytest.raises(ex.DeviceOverload):
        client.get(k)
    server.drop_next(1)
    with pytest.raises(ex.ConnectionError):
        client.get(k)
    server.drop_next(1, after_apply=True)
    with pytest.raises(ex.ConnectionError) as info:
        client.put(k, {"v": b"2"})
    assert info.value.in_doubt
    assert client.get(k)[2] == {"v": b"2"}  # it landed
    server.latency = 3.0
    start = time.monotonic()
    with pytest.raises(ex.TimeoutError):
        client.get(k, policy={"total_timeout": 100, "max_retries": 0})
    assert time.monotonic() - start < 2.0  # the client's 100 ms timeout, not the server's 3 s
    server.latency = 0
    server.fail_next(14, skip=1)
    client.get(k)
    with pytest.raises(ex.RecordBusy):
        client.get(k)


def test_stop_and_start_on_the_same_port_keep_records(
    client: Any, server: AerospikeTestServer
) -> None:
    k = key(b"persist")
    client.put(k, {"v": b"1"})
    port = server.port
    server.stop()
    with pytest.raises(ex.AerospikeError):
        client.get(k)
    server.start()
    assert server.port == port
    deadline = time.monotonic() + 5
    while True:
        try:
            assert client.get(k)[2] == {"v": b"1"}
            break
        except ex.AerospikeError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_refused_connections(server: AerospikeTestServer) -> None:
    server.refuse_connections = True
    with pytest.raises(ex.AerospikeError):
        aerospike.client({"hosts": [(server.host, server.port)], "connect_timeout": 500})


def test_oversized_request_drops_the_connection(server: AerospikeTestServer) -> None:
    with socket.create_connection((server.host, server.port), timeout=5) as s:
        s.sendall(struct.pack(">Q", (2 << 56) | (3 << 48) | (128 * MiB + 1)))
        assert s.recv(1) == b""  # closed without reading the body


def test_unknown_namespace_rows(client: Any) -> None:
    with pytest.raises(ex.NamespaceNotFound):
        client.get(key(b"x", ns="nope"))
