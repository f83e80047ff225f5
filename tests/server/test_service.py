"""The gRPC service through the generated (standard protobuf) stubs: tenants, roles, limits, validation."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator

import grpc
import pytest

from kvtier.wire import kvtier_cache_pb2 as pb
from tests.server.helpers import (
    TOKENS,
    auth,
    block,
    key,
    metric,
    running_server,
    server_config,
    stub,
    tenants,
)

MiB = 1 << 20


def put_frames(k: bytes, data: bytes, chunk: int = 64 * 1024) -> list[pb.PutFrame]:
    frames = [pb.PutFrame(key=k, size=len(data), data=data[:chunk])]
    frames += [pb.PutFrame(data=data[o : o + chunk]) for o in range(chunk, len(data), chunk)]
    return frames


def as_batches(frames: Iterable[pb.PutFrame], per_batch: int = 1) -> Iterator[pb.PutBatch]:
    """Lazily, ``per_batch`` frames to a PutBatch message."""
    pending: list[pb.PutFrame] = []
    for f in frames:
        pending.append(f)
        if len(pending) == per_batch:
            yield pb.PutBatch(frames=pending)
            pending = []
    if pending:
        yield pb.PutBatch(frames=pending)


def get_blocks(s, keys: list[bytes], token: str | None) -> list[bytes | None]:
    out: list[bytes | None] = [None] * len(keys)
    parts: dict[int, list[bytes]] = {}
    for batch in s.Get(pb.KeysRequest(keys=keys), metadata=auth(token), timeout=10):
        for f in batch.frames:
            if f.found:
                parts.setdefault(f.index, []).append(f.data)
    for i, p in parts.items():
        out[i] = b"".join(p)
    return out


def code_of(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def closed_server():
    cfg = server_config(
        open=False,
        tenants=tenants(),
        max_block_size=MiB,
        max_message_size=256 * 1024,
        chunk_size=64 * 1024,
        max_keys_per_call=64,
        max_inflight_put_bytes=2 * MiB,
        tenant_max_inflight_put_bytes=2 * MiB,  # the shared budget is tested here
        http_port=None,
    )
    with running_server(cfg) as server:
        channel, s = stub(server.address)
        yield server, s
        channel.close()


def test_round_trip_with_the_standard_protobuf_client(closed_server) -> None:
    _server, s = closed_server
    tok = TOKENS["alpha"]
    items = [(key(1000 + i), block(1000 + i, tokens=300)) for i in range(3)]
    for k, b in items:
        resp = s.Put(as_batches(put_frames(k, b)), metadata=auth(tok), timeout=10)
        assert (resp.blocks, resp.bytes) == (1, len(b))
    ks = [k for k, _ in items]
    assert s.Lookup(pb.KeysRequest(keys=[*ks, key(1)]), metadata=auth(tok)).prefix_length == 3
    assert list(s.Exists(pb.KeysRequest(keys=[key(1), *ks]), metadata=auth(tok)).present) == [
        False,
        True,
        True,
        True,
    ]
    assert get_blocks(s, [*ks, key(1)], tok) == [b for _, b in items] + [None]
    assert s.Delete(pb.KeysRequest(keys=ks[:1]), metadata=auth(tok)).deleted == 1
    assert get_blocks(s, ks[:1], tok) == [None]


def test_multi_block_put_stream(closed_server) -> None:
    _server, s = closed_server
    tok = TOKENS["alpha"]
    items = [(key(1100 + i), block(1100 + i, tokens=40 + i)) for i in range(5)]
    frames = [f for k, b in items for f in put_frames(k, b, chunk=1000)]
    resp = s.Put(as_batches(frames, per_batch=7), metadata=auth(tok), timeout=10)
    assert resp.blocks == 5
    assert get_blocks(s, [k for k, _ in items], tok) == [b for _, b in items]


def test_tenants_cannot_read_detect_or_delete_each_others_blocks(closed_server) -> None:
    _server, s = closed_server
    a, b = TOKENS["alpha"], TOKENS["beta"]
    k = key(1200)
    block_a, block_b = block(1, bound=k), block(2, bound=k)
    s.Put(as_batches(put_frames(k, block_a)), metadata=auth(a), timeout=10)
    assert get_blocks(s, [k], a) == [block_a]
    # beta asks for the very same 16 bytes: nothing there, by any call
    assert s.Lookup(pb.KeysRequest(keys=[k]), metadata=auth(b)).prefix_length == 0
    assert list(s.Exists(pb.KeysRequest(keys=[k]), metadata=auth(b)).present) == [False]
    assert get_blocks(s, [k], b) == [None]
    assert s.Delete(pb.KeysRequest(keys=[k]), metadata=auth(b)).deleted == 0
    assert get_blocks(s, [k], a) == [block_a]
    # beta's own block under the same key is a different block
    s.Put(as_batches(put_frames(k, block_b)), metadata=auth(b), timeout=10)
    assert get_blocks(s, [k], b) == [block_b]
    assert get_blocks(s, [k], a) == [block_a]
    assert s.Delete(pb.KeysRequest(keys=[k]), metadata=auth(a)).deleted == 1
    assert get_blocks(s, [k], b) == [block_b]


def test_closed_server_needs_a_known_token(closed_server) -> None:
    server, s = closed_server
    req = pb.KeysRequest(keys=[key(1)])
    for md in [
        (),
        auth("not-a-token"),
        (("authorization", "Basic abc"),),
        (("authorization", "Bearer"),),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            s.Lookup(req, metadata=md)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        s.Put(as_batches(put_frames(key(1), block(1))), metadata=auth("nope"))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Health answers without a token (load balancers), but not to a wrong one.
    h = s.Health(pb.HealthRequest())
    assert (
        h.status == pb.HealthResponse.SERVING
        and h.tenant == ""
        and h.limits.max_keys_per_call == 64
    )
    assert s.Health(pb.HealthRequest(), metadata=auth(TOKENS["beta"])).tenant == "beta"
    assert code_of(lambda: s.Health(pb.HealthRequest(), metadata=auth("x"))) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    assert metric(server, "kvtier_server_rejected_total", reason="unauthenticated") >= 5


def test_roles() -> None:
    cfg = server_config(
        open=False,
        http_port=None,
        tenants=tenants({"alpha": "reader", "beta": "writer", "ops": "admin"}),
    )
    with running_server(cfg) as server:
        channel, s = stub(server.address)
        reader, writer, admin = TOKENS["alpha"], TOKENS["beta"], TOKENS["ops"]
        for fn in (
            lambda: s.Put(as_batches(put_frames(key(1), block(1))), metadata=auth(reader)),
            lambda: s.Delete(pb.KeysRequest(keys=[key(1)]), metadata=auth(reader)),
        ):
            assert code_of(fn) == grpc.StatusCode.PERMISSION_DENIED
        assert s.Lookup(pb.KeysRequest(keys=[key(1)]), metadata=auth(reader)).prefix_length == 0
        s.Put(as_batches(put_frames(key(1), block(1))), metadata=auth(writer))
        # a reader sees its own row only; an admin sees every tenant
        mine = s.Stats(pb.StatsRequest(), metadata=auth(reader))
        assert [t.name for t in mine.tenants] == ["alpha"]
        everyone = s.Stats(pb.StatsRequest(), metadata=auth(admin))
        assert {"alpha", "beta"} <= {t.name for t in everyone.tenants}
        denied = {t.name: t for t in everyone.tenants}["alpha"]
        assert denied.errors == 2  # refused calls count against the tenant that made them
        assert everyone.bytes_in == len(block(1))
        channel.close()


@pytest.mark.parametrize(
    ("keys", "code", "words"),
    [
        ([b"short"], grpc.StatusCode.INVALID_ARGUMENT, "key #0 is 5 bytes"),
        ([key(1), b"x" * 17], grpc.StatusCode.INVALID_ARGUMENT, "key #1 is 17 bytes"),
        ([key(1), b""], grpc.StatusCode.INVALID_ARGUMENT, "key #1 is 0 bytes"),
        ([key(i) for i in range(65)], grpc.StatusCode.RESOURCE_EXHAUSTED, "65 keys"),
    ],
)
def test_bad_keys_are_refused_by_every_keyed_call(closed_server, keys, code, words) -> None:
    _server, s = closed_server
    md = auth(TOKENS["alpha"])
    req = pb.KeysRequest(keys=keys)
    calls = [
        lambda: s.Lookup(req, metadata=md),
        lambda: s.Exists(req, metadata=md),
        lambda: list(s.Get(req, metadata=md)),
        lambda: s.Delete(req, metadata=md),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == code
        assert words in e.value.details()


def _bad_puts(k: bytes) -> list[tuple[str, list[pb.PutFrame], grpc.StatusCode, str]]:
    good = block(5, tokens=200, bound=k)
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0xFF
    lying = bytearray(good)
    lying[20] ^= 0x01  # the header's token count no longer matches the payload
    return [
        (
            "corrupt payload",
            put_frames(k, bytes(flipped)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "checksum",
        ),
        (
            "lying header",
            put_frames(k, bytes(lying)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "not a valid",
        ),
        (
            "stream ends inside the block",
            put_frames(k, good, chunk=1000)[:-1],
            grpc.StatusCode.INVALID_ARGUMENT,
            "ended inside",
        ),
        (
            "declared size larger than data",
            [pb.PutFrame(key=k, size=len(good) + 1, data=good)],
            grpc.StatusCode.INVALID_ARGUMENT,
            "ended inside",
        ),
        (
            "more data than declared",
            [pb.PutFrame(key=k, size=len(good) - 1, data=good)],
            grpc.StatusCode.INVALID_ARGUMENT,
            "more data",
        ),
        (
            "data before a key",
            [pb.PutFrame(data=good)],
            grpc.StatusCode.INVALID_ARGUMENT,
            "before any block",
        ),
        (
            "size without key",
            [pb.PutFrame(size=10)],
            grpc.StatusCode.INVALID_ARGUMENT,
            "no key",
        ),
        ("short key", put_frames(k[:8], good), grpc.StatusCode.INVALID_ARGUMENT, "8 bytes"),
        (
            "not a block at all",
            put_frames(k, b"hello world" * 10),
            grpc.StatusCode.INVALID_ARGUMENT,
            "not a valid",
        ),
        (
            "block over max_block_size",
            [pb.PutFrame(key=k, size=MiB + 1, data=b"x")],
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "at most",
        ),
        (
            "frame over max_message_size",
            [pb.PutFrame(key=k, size=400_000, data=b"x" * 400_000)],
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "",
        ),
        (
            "too many blocks in one stream",
            [f for i in range(65) for f in put_frames(key(5000 + i), block(5000 + i))],
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "more than 64 blocks",
        ),
        (
            "a valid block of another key",
            put_frames(k, block(5, tokens=200)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "not for key",
        ),
    ]


@pytest.mark.parametrize("case", range(13))
def test_bad_puts_get_a_clear_status_and_store_nothing(closed_server, case: int) -> None:
    _server, s = closed_server
    md = auth(TOKENS["alpha"])
    k = key(2000 + case)
    name, frames, code, words = _bad_puts(k)[case]
    with pytest.raises(grpc.RpcError) as e:
        s.Put(as_batches(frames), metadata=md, timeout=10)
    assert e.value.code() == code, name
    assert words in (e.value.details() or ""), (name, e.value.details())
    assert s.Lookup(pb.KeysRequest(keys=[k]), metadata=md).prefix_length == 0, name
    # and the server goes on serving
    good = block(7, bound=k)
    s.Put(as_batches(put_frames(k, good)), metadata=md, timeout=10)
    assert get_blocks(s, [k], TOKENS["alpha"]) == [good]


def test_put_byte_budget_refuses_while_full(closed_server) -> None:
    server, s = closed_server
    md = auth(TOKENS["alpha"])
    # 0.85 MiB each: two fit in the 2 MiB budget, three do not
    big = {i: block(9, tokens=7000, bound=key(i)) for i in (3001, 3002, 3003)}
    size = len(big[3001])
    assert size <= MiB
    release = threading.Event()

    def slow_frames(i: int) -> Iterator[pb.PutFrame]:
        frames = put_frames(key(i), big[i])
        yield frames[0]
        release.wait(10)
        yield from frames[1:]

    # two streams reserve ~2 MiB together (the budget); the third is refused
    f1 = s.Put.future(as_batches(slow_frames(3001)), metadata=md, timeout=20)
    f2 = s.Put.future(as_batches(slow_frames(3002)), metadata=md, timeout=20)
    deadline = time.monotonic() + 10
    while server.service.put_budget.used < 2 * size:
        assert time.monotonic() < deadline, "the two streams never reserved their blocks"
        time.sleep(0.01)
    with pytest.raises(grpc.RpcError) as e:
        s.Put(as_batches(put_frames(key(3003), big[3003])), metadata=md, timeout=10)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "too many bytes at once" in e.value.details()
    release.set()
    assert f1.result().blocks == 1 and f2.result().blocks == 1
    assert server.service.put_budget.used == 0
    s.Put(as_batches(put_frames(key(3003), big[3003])), metadata=md, timeout=10)


def test_cancelled_put_stream_leaves_no_partial_block(closed_server) -> None:
    server, s = closed_server
    md = auth(TOKENS["alpha"])
    k = key(4000)
    data = block(11, tokens=2000)
    frames = put_frames(k, data, chunk=16 * 1024)
    sent_half = threading.Event()
    never = threading.Event()

    def cut_off() -> Iterator[pb.PutFrame]:
        yield from frames[: len(frames) // 2]
        sent_half.set()
        never.wait(10)
        yield from frames[len(frames) // 2 :]

    before = metric(server, "kvtier_server_incomplete_puts_total")
    future = s.Put.future(as_batches(cut_off()), metadata=md, timeout=20)
    assert sent_half.wait(5)
    deadline = time.monotonic() + 10
    while server.service.put_budget.used == 0:  # the server holds part of the block
        assert time.monotonic() < deadline, "the Put never reached the server"
        time.sleep(0.02)
    future.cancel()
    deadline = time.monotonic() + 5
    while metric(server, "kvtier_server_incomplete_puts_total") == before:
        assert time.monotonic() < deadline, "the server never noticed the cancelled stream"
        time.sleep(0.02)
    never.set()
    assert s.Lookup(pb.KeysRequest(keys=[k]), metadata=md).prefix_length == 0
    assert get_blocks(s, [k], TOKENS["alpha"]) == [None]
    assert server.service.put_budget.used == 0


def test_open_server_serves_anonymous_but_refuses_wrong_tokens() -> None:
    with running_server(server_config(http_port=None, tenants=tenants())) as server:
        assert server.config.is_open  # loopback default
        channel, s = stub(server.address)
        k = key(1)
        s.Put(as_batches(put_frames(k, block(1))))
        assert s.Lookup(pb.KeysRequest(keys=[k])).prefix_length == 1
        # anonymous is a tenant of its own
        assert s.Lookup(pb.KeysRequest(keys=[k]), metadata=auth(TOKENS["alpha"])).prefix_length == 0
        assert code_of(lambda: s.Lookup(pb.KeysRequest(keys=[k]), metadata=auth("bad"))) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
        channel.close()


def test_draining_server_refuses_new_calls_with_unavailable() -> None:
    with running_server(server_config(http_port=None)) as server:
        channel, s = stub(server.address)
        server.service.drain()
        assert (
            code_of(lambda: s.Lookup(pb.KeysRequest(keys=[key(1)]))) == grpc.StatusCode.UNAVAILABLE
        )
        assert s.Health(pb.HealthRequest()).status == pb.HealthResponse.DRAINING
        channel.close()
