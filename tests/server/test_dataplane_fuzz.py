"""Hypothesis-driven malformed data-plane frames: each is answered with an error STATUS or a
closed connection, nothing partial is stored, and the server keeps serving."""

from __future__ import annotations

import itertools
import string

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.wire import dataplane as wire
from tests.server.helpers import (
    TOKENS,
    block,
    key,
    remote,
    running_server,
    server_config,
    tenants,
    wait_until,
)
from tests.server.rawdp import RawConn

MAX_KEYS = 32
MAX_BLOCK = 256 * 1024
OK = grpc.StatusCode.OK.value[0]

_ids = itertools.count(200_000)


@pytest.fixture(scope="module")
def fuzz_server():
    cfg = server_config(
        open=False,
        http_port=None,
        tenants=tenants(),
        max_keys_per_call=MAX_KEYS,
        max_block_size=MAX_BLOCK,
        max_inflight_put_bytes=4 * MAX_BLOCK,
        data_io_timeout_s=5,
    )
    with running_server(cfg) as server:
        yield server


def _exchange(server, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection, end our side, and read all the server says until it
    closes (a hung server fails the test by the read timeout)."""
    with RawConn(server.data_port, timeout=10) as conn:
        try:
            conn.send(data)
            conn.half_close()
        except OSError:
            pass  # the server refused early and closed: what it said is still readable
        return conn.read_to_end()


def _statuses(reply: bytes) -> list[wire.Status]:
    """The hello's STATUS, then the first request's if the server answered it."""
    out = []
    pos = wire.HELLO_REPLY.size
    while len(out) < 2 and pos + wire.STATUS.size <= len(reply):
        code, n = wire.STATUS.unpack_from(reply, pos)
        pos += wire.STATUS.size
        out.append(wire.Status(code, reply[pos : pos + n].decode("utf-8", "replace")))
        pos += n
        if code != OK:
            assert pos == len(reply), "nothing follows a refusal: the connection ends"
            break
    return out


def _alive(server) -> None:
    with RawConn(server.data_port) as conn:
        assert conn.hello(TOKENS["alpha"]).ok
        assert conn.get([key(1)]) in ([None], [block(1)])


tokens = st.one_of(
    st.just(TOKENS["alpha"]),
    st.none(),
    st.text(alphabet=string.ascii_letters + string.digits + "-_.", min_size=1, max_size=40),
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    magic=st.one_of(st.just(wire.MAGIC), st.binary(min_size=4, max_size=4)),
    version=st.one_of(st.just(wire.DATA_PROTOCOL_VERSION), st.integers(0, 0xFFFF)),
    token=tokens,
    lie=st.integers(-5, 5000),
    cut=st.one_of(st.none(), st.integers(0, 60)),
)
def test_malformed_handshakes_are_refused_and_closed(fuzz_server, magic, version, token, lie, cut):
    raw = (token or "").encode()
    token_len = max(0, min(0xFFFF, len(raw) + lie)) if lie else len(raw)
    hello = wire.HELLO.pack(magic, version, token_len) + raw
    good = (
        magic == wire.MAGIC
        and version == wire.DATA_PROTOCOL_VERSION
        and token == TOKENS["alpha"]
        and token_len == len(raw)
        and (cut is None or cut >= len(hello))
    )
    reply = _exchange(fuzz_server, hello if cut is None else hello[:cut])
    if reply:
        assert reply[:4] == wire.MAGIC
        code, n = wire.STATUS.unpack_from(reply, wire.HELLO_REPLY.size)
        assert (code == OK) == good
        assert code == OK or n > 0, "every refusal says why"
    else:
        assert not good  # a stream cut inside the hello: closed without an answer
    _alive(fuzz_server)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=st.binary(max_size=300))
def test_garbage_after_the_handshake_closes_the_connection(fuzz_server, body):
    # (the read to the end of the stream is the check that the server closed the connection)
    statuses = _statuses(_exchange(fuzz_server, wire.hello(TOKENS["alpha"]) + body))
    assert statuses[0].ok
    if len(body) >= wire.REQUEST.size:
        op, count = wire.REQUEST.unpack_from(body)
        if op not in (wire.OP_GET, wire.OP_PUT):
            assert statuses[1].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "unknown data-plane op" in statuses[1].message
        elif count > MAX_KEYS:
            assert statuses[1].code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    _alive(fuzz_server)


MUTATIONS = [
    "ok",
    "truncate",
    "flip",
    "declare_more",
    "declare_less",
    "zero",
    "short_key",
    "huge",
    "lying_count",
]


def _item(k: bytes, data: bytes, mutation: str, draw) -> tuple[bytes, bool]:
    """One PUT item spoiled as ``mutation`` says, and whether the stream ends after it."""
    if mutation == "ok":
        return wire.PUT_ITEM.pack(k, len(data)) + data, False
    if mutation == "truncate":
        cut = draw(st.integers(0, len(data) - 1))
        return wire.PUT_ITEM.pack(k, len(data)) + data[:cut], True
    if mutation == "flip":
        pos = draw(st.integers(0, len(data) - 1))
        bad = bytearray(data)
        bad[pos] ^= draw(st.integers(1, 255))
        return wire.PUT_ITEM.pack(k, len(data)) + bytes(bad), False
    if mutation == "declare_more":
        return wire.PUT_ITEM.pack(k, len(data) + draw(st.integers(1, 1000))) + data, True
    if mutation == "declare_less":
        less = draw(st.integers(1, len(data) - 1))
        return wire.PUT_ITEM.pack(k, len(data) - less) + data, False
    if mutation == "zero":
        return wire.PUT_ITEM.pack(k, 0) + data, False
    if mutation == "short_key":
        short = k[: draw(st.integers(0, 15))]
        return short + len(data).to_bytes(8, "big") + data, False
    if mutation == "huge":
        return wire.PUT_ITEM.pack(k, MAX_BLOCK + draw(st.integers(1, 1 << 40))) + data, False
    if mutation == "lying_count":
        return b"", True  # the request promised one more block than it sends
    raise AssertionError(mutation)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_puts_with_spoiled_blocks_store_only_the_complete_valid_ones(fuzz_server, data):
    server = fuzz_server
    plan = data.draw(st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=3), label="blocks")
    count = len(plan)
    items, body = [], b""
    for mutation in plan:
        i = next(_ids)
        b = block(i, tokens=data.draw(st.integers(1, 400), label="tokens"))
        items.append((key(i), b, mutation))
        piece, ends = _item(key(i), b, mutation, data.draw)
        body += piece
        if ends:
            break
    request = wire.hello(TOKENS["alpha"]) + wire.REQUEST.pack(wire.OP_PUT, count) + body
    statuses = _statuses(_exchange(server, request))
    assert statuses[0].ok
    first_bad = next((j for j, (_, _, m) in enumerate(items) if m != "ok"), None)
    if first_bad is None:
        assert [s.code for s in statuses[1:]] == [OK]
        stored_upto = len(items)
    else:
        # refused with a reason, or (a stream cut short) closed without an answer
        assert all(not s.ok and s.message for s in statuses[1:]), statuses
        stored_upto = first_bad
    tier = remote(server, token=TOKENS["alpha"])
    ks = [k for k, _, _ in items]
    # nothing from the first spoiled block on is readable; what is stored is exact
    assert tier.get(ks) == [b for _, b, _ in items[:stored_upto]] + [None] * (
        len(items) - stored_upto
    )
    tier.close()
    _alive(server)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    op=st.integers(0, 255),
    count=st.integers(0, (1 << 32) - 1),
    keys=st.binary(max_size=40 * 16),
)
def test_gets_and_unknown_ops_with_lying_counts(fuzz_server, op, count, keys):
    request = wire.hello(TOKENS["alpha"]) + wire.REQUEST.pack(op, count) + keys
    statuses = _statuses(_exchange(fuzz_server, request))
    assert statuses[0].ok
    if op not in (wire.OP_GET, wire.OP_PUT) or count > MAX_KEYS:
        assert len(statuses) == 2 and not statuses[1].ok and statuses[1].message
    elif op == wire.OP_GET:
        # all the keys came: answered (misses); a stream cut inside the keys: closed unanswered
        assert len(statuses) == (2 if len(keys) >= 16 * count else 1)
        assert all(s.ok for s in statuses)
    _alive(fuzz_server)


def test_the_server_is_consistent_after_the_fuzzing(fuzz_server):
    tier = remote(fuzz_server, token=TOKENS["alpha"])
    k, b = key(1), block(1, tokens=500)
    assert tier.put([(k, b)]) == [True]
    assert tier.get([k]) == [b]
    tier.close()
    fuzz_server.store.check_integrity()
    wait_until(
        lambda: fuzz_server.service.put_budget.used == 0,
        "every refused or cut put released its bytes",
    )
