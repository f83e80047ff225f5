"""The Aerospike tier under failure: error mapping, retries, timeouts, stop-writes, the breaker.

Tests taking ``target`` run on the test run's real server (tests/support/aerospike_target.py);
the others need a fault of the emulator and name it (``aerospike_emulator``). A real cluster
losing and pausing nodes is in tests/kvtier/test_aerospike_cluster.py.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import pytest

from kvtier.breaker import BreakerState
from kvtier.errors import ConfigError, TierUnavailableError, TransientError
from kvtier.tiers.aerospike import AerospikeTier
from kvtier.tiers.aerospike_config import AerospikeTierConfig
from tests.support.aerospike_server import AerospikeTestServer, NamespaceConfig
from tests.support.aerospike_target import Target, make_target
from tests.support.timeouts import aerospike_timeouts

WIRE = "a chosen wire-level fault"
CODE = "a chosen server error code"
DOWN = "the whole server down, then back on its port with its records"

KiB, MiB = 1024, 1024 * 1024


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def server() -> Iterator[AerospikeTestServer]:
    with AerospikeTestServer() as srv:
        yield srv


@pytest.fixture
def target() -> Iterator[Target]:
    t = make_target()
    yield t
    t.close()


def make_tier(
    srv: AerospikeTestServer | Target | str, clock: FakeClock | None = None, **overrides: object
) -> AerospikeTier:
    if isinstance(srv, Target):
        overrides.setdefault("namespace", srv.namespace)
        overrides.setdefault("set_name", srv.set_name)
    address = srv if isinstance(srv, str) else srv.address
    # NOTE: the emulator is one node, where the client's retry on the replica would go to the
    # same node and hide the fault from the tier: these tests check the tier's own handling.
    overrides.setdefault("replica_retries", 0)
    overrides.setdefault("retry_backoff_ms", 1)
    overrides.setdefault("retry_backoff_cap_ms", 2)
    for name, value in aerospike_timeouts().items():  # tests of timeouts set their own
        overrides.setdefault(name, value)
    cfg = AerospikeTierConfig(hosts=[address], **overrides)  # type: ignore[arg-type]
    if clock is None:
        return AerospikeTier(cfg)
    return AerospikeTier(cfg, clock=clock)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.aerospike_emulator(f"{WIRE}: every reply held 3 s")
def test_timeout_is_transient_and_bounded(server: AerospikeTestServer) -> None:
    tier = make_tier(server, total_timeout_ms=100, socket_timeout_ms=100, max_retries=1)
    key = os.urandom(16)
    tier.put([(key, b"a" * 100)])
    server.latency = 3.0
    start = time.monotonic()
    with pytest.raises(TransientError):
        tier.get([key])
    assert time.monotonic() - start < 2.5  # two attempts of ~0.1 s, not the server's 2 x 3 s
    stats = tier.stats()
    assert stats.retries == 1 and stats.transient_errors == 1
    server.latency = 0
    time.sleep(0.5)  # let the held replies drain
    assert tier.get([key]) == [b"a" * 100]
    tier.close()


@pytest.mark.aerospike_emulator(f"{WIRE}: a connection dropped")
def test_dropped_connection_is_retried(server: AerospikeTestServer) -> None:
    tier = make_tier(server, max_retries=2)
    key = os.urandom(16)
    tier.put([(key, b"b" * 100)])
    server.drop_next(1)
    assert tier.get([key]) == [b"b" * 100]
    assert tier.stats().retries == 1
    tier.close()


@pytest.mark.aerospike_emulator(f"{WIRE}: a connection dropped")
def test_dropped_connection_without_retries_is_transient(server: AerospikeTestServer) -> None:
    tier = make_tier(server, max_retries=0)
    server.drop_next(1)
    with pytest.raises(TransientError):
        tier.contains([os.urandom(16), os.urandom(16)])
    assert tier.stats().retries == 0
    tier.close()


@pytest.mark.aerospike_emulator(CODE)
@pytest.mark.parametrize("code", [18, 14, 9])
def test_overload_busy_and_server_timeout_are_retried(
    server: AerospikeTestServer, code: int
) -> None:
    tier = make_tier(server, max_retries=2)
    keys = [os.urandom(16), os.urandom(16)]
    tier.put([(k, b"c" * 10) for k in keys])
    server.reset_counts()
    server.fail_next(code)
    assert tier.get(keys) == [b"c" * 10] * 2
    assert server.counts["batch"] == 2
    assert tier.stats().retries == 1
    tier.close()


@pytest.mark.aerospike_emulator(CODE)
def test_namespace_error_is_config_and_not_retried(server: AerospikeTestServer) -> None:
    tier = make_tier(server, max_retries=3)
    server.reset_counts()
    server.fail_next(20)
    with pytest.raises(ConfigError, match="namespace"):
        tier.get([os.urandom(16), os.urandom(16)])
    assert server.counts["batch"] == 1
    assert tier.stats().retries == 0
    assert tier.breaker.state is BreakerState.CLOSED
    tier.close()


@pytest.mark.aerospike_emulator(CODE)
def test_unknown_errors_are_transient_but_not_retried(server: AerospikeTestServer) -> None:
    tier = make_tier(server, max_retries=3)
    server.reset_counts()
    server.fail_next(31)  # a code the tier has no mapping for
    with pytest.raises(TransientError):
        tier.get([os.urandom(16), os.urandom(16)])
    assert server.counts["batch"] == 1
    assert tier.stats().retries == 0
    tier.close()


def test_record_too_big_names_the_setting_and_is_not_retried(target: Target) -> None:
    tier = make_tier(target, max_retries=3)
    assert tier.limits is not None and tier.limits.segment_size > 900 * KiB
    target.set_max_record_size(256 * KiB)  # the operator lowered the cap
    before = tier.stats()
    with pytest.raises(ConfigError, match="segment_size"):
        tier.put([(os.urandom(16), os.urandom(900 * KiB))])
    after = tier.stats()
    assert after.retries == before.retries  # not retried
    assert tier.limits.max_record_size == 256 * KiB  # re-learned
    key, block = os.urandom(16), os.urandom(900 * KiB)
    assert tier.put([(key, block)]) == [True]  # now segmented
    assert tier.get([key]) == [block]
    tier.close()


def test_segment_size_override_larger_than_the_cap_is_config_error() -> None:
    target = make_target(max_record_size=128 * KiB)
    tier = make_tier(target, segment_size="1MiB")
    try:
        with pytest.raises(ConfigError, match="segment_size"):
            tier.put([(os.urandom(16), b"x")])
        with pytest.raises(ConfigError, match="segment_size"):
            tier.connect()
    finally:
        tier.close()
        target.close()


def test_margin_that_leaves_nothing_is_config_error() -> None:
    target = make_target(max_record_size=64 * KiB)
    tier = make_tier(target, record_size_margin="64KiB")
    try:
        with pytest.raises(ConfigError, match="record_size_margin"):
            tier.connect()
    finally:
        tier.close()
        target.close()


STOP_WRITES = "stop-writes on demand (a real node enters and leaves it on its periodic check, 8 s and more here)"


@pytest.mark.aerospike_emulator(STOP_WRITES)
def test_stop_writes_drops_puts_and_reads_keep_working(server: AerospikeTestServer) -> None:
    tier = make_tier(server, segment_size=16 * KiB)
    old = os.urandom(16)
    tier.put([(old, b"d" * 1000)])
    server.stop_writes = True
    new_small, new_big = os.urandom(16), os.urandom(16)
    assert tier.put([(new_small, b"e" * 1000), (new_big, os.urandom(50 * KiB))]) == [False, False]
    assert tier.stats().stop_writes_drops == 2
    assert tier.get([old, new_small, new_big]) == [b"d" * 1000, None, None]
    assert tier.contains([old, new_small]) == [True, False]
    assert tier.breaker.state is BreakerState.CLOSED
    assert len(server.digests("kvcache")) == 1
    server.stop_writes = False
    assert tier.put([(new_small, b"e" * 1000)]) == [True]
    tier.close()


@pytest.mark.aerospike_emulator(
    "a namespace with nsup-period 0 (the real cluster runs the deployed namespace, nsup on)"
)
def test_ttl_without_nsup_is_config_error() -> None:
    with AerospikeTestServer([NamespaceConfig(nsup_period=0)]) as srv:
        tier = make_tier(srv, ttl_s=3600)
        with pytest.raises(ConfigError, match="nsup-period"):
            tier.connect()
        with pytest.raises(ConfigError, match="nsup-period"):
            tier.put([(os.urandom(16), b"x")])
        tier.close()
        forever = make_tier(srv, ttl_s=-1)
        key = os.urandom(16)
        assert forever.put([(key, b"x")]) == [True]
        assert forever.get([key]) == [b"x"]
        forever.close()


@pytest.mark.aerospike_emulator(f"{CODE}: 22 while the namespace reports nsup on")
def test_server_refusing_ttl_writes_maps_to_config_error() -> None:
    # The tier's own check passes (nsup looks on), but the server says 22 anyway.
    with AerospikeTestServer() as srv:
        tier = make_tier(srv, ttl_s=3600)
        srv.namespaces["kvcache"].nsup_period = 0
        with pytest.raises(ConfigError, match="nsup"):
            tier.put([(os.urandom(16), b"x")])
        tier.close()


def test_unknown_namespace_is_config_error(target: Target) -> None:
    tier = make_tier(target, namespace="nope")  # construction does not raise
    with pytest.raises(ConfigError, match="nope"):
        tier.get([os.urandom(16)])
    with pytest.raises(ConfigError, match="nope"):
        tier.connect()
    tier.close()


@pytest.mark.aerospike_emulator("a legacy server's reply (write-block-size, before 7.0)")
def test_legacy_servers_report_write_block_size() -> None:
    with AerospikeTestServer(
        [NamespaceConfig(max_record_size=256 * KiB, legacy_write_block_size=True)]
    ) as srv:
        tier = make_tier(srv)
        assert tier.limits is not None
        assert tier.limits.source == "write-block-size"
        assert tier.limits.max_record_size == 256 * KiB
        key, block = os.urandom(16), os.urandom(600 * KiB)
        assert tier.put([(key, block)]) == [True]
        assert tier.get([key]) == [block]
        tier.close()


@pytest.mark.aerospike_emulator(DOWN)
def test_breaker_opens_skips_without_io_and_recovers() -> None:
    """Reads and writes have a breaker each: failed reads open the read one, failed writes
    the write one (a lost node fails only the writes its replica cannot take)."""
    clock = FakeClock()
    with AerospikeTestServer() as srv:
        tier = make_tier(srv, clock, breaker_threshold=3, breaker_cooldown_s=10, max_retries=1)
        key = os.urandom(16)
        tier.put([(key, b"f" * 100)])
        srv.stop()
        for _ in range(3):
            with pytest.raises(TransientError) as info:
                tier.get([key])
            assert not isinstance(info.value, TierUnavailableError)
        assert tier.breaker.state is BreakerState.OPEN
        assert tier.write_breaker.state is BreakerState.CLOSED  # no write failed yet
        for _ in range(3):
            with pytest.raises(TransientError) as info:
                tier.put([(key, b"f")])
            assert not isinstance(info.value, TierUnavailableError)
        assert tier.write_breaker.state is BreakerState.OPEN
        trips = tier.stats().round_trips
        srv.reset_counts()
        for _ in range(5):
            with pytest.raises(TierUnavailableError, match="reads"):
                tier.get([key])
            with pytest.raises(TierUnavailableError, match="writes"):
                tier.put([(key, b"f")])
        assert tier.stats().round_trips == trips  # skipped without network I/O
        assert tier.stats().skipped_calls == 10
        srv.start()
        assert srv.message_count() == 0
        clock.now += 10
        assert tier.get([key]) == [b"f" * 100]  # the probe of reads
        assert tier.breaker.state is BreakerState.CLOSED
        assert tier.put([(os.urandom(16), b"g")]) == [True]  # the probe of writes
        assert tier.write_breaker.state is BreakerState.CLOSED
        assert tier.stats().breaker_opens == 2
        tier.close()


@pytest.mark.aerospike_emulator(DOWN)
def test_failed_probe_reopens() -> None:
    clock = FakeClock()
    with AerospikeTestServer() as srv:
        tier = make_tier(srv, clock, breaker_threshold=1, breaker_cooldown_s=5, max_retries=0)
        srv.stop()
        with pytest.raises(TransientError):
            tier.contains([os.urandom(16)])
        clock.now += 5
        with pytest.raises(TransientError) as info:
            tier.contains([os.urandom(16)])  # the probe fails
        assert not isinstance(info.value, TierUnavailableError)
        with pytest.raises(TierUnavailableError):
            tier.contains([os.urandom(16)])
        assert tier.stats().breaker_opens == 2
        tier.close()


@pytest.mark.aerospike_emulator("a server that starts on a chosen port after its client")
def test_server_down_at_construction_does_not_crash_the_owner() -> None:
    clock = FakeClock()
    port = free_port()
    tier = make_tier(f"127.0.0.1:{port}", clock, breaker_cooldown_s=10)
    assert tier.limits is None
    with pytest.raises(TierUnavailableError):
        tier.get([os.urandom(16)])
    assert tier.usage().used_bytes == 0  # never raises
    with AerospikeTestServer(port=port) as srv:
        clock.now += 10
        key = os.urandom(16)
        assert tier.put([(key, b"g" * 10)]) == [True]  # the probe connects
        assert tier.get([key]) == [b"g" * 10]
        assert srv.message_count() == 2  # the put's one write, the get
    tier.close()


@pytest.mark.aerospike_emulator(f"{WIRE}: connections refused")
def test_refused_connections_then_recovery() -> None:
    clock = FakeClock()
    with AerospikeTestServer() as srv:
        tier = make_tier(srv, clock, breaker_threshold=2, breaker_cooldown_s=1, max_retries=0)
        key = os.urandom(16)
        tier.put([(key, b"h")])
        srv.refuse_connections = True
        srv.drop_connections()
        for _ in range(2):
            with pytest.raises(TransientError):
                tier.get([key])
        with pytest.raises(TierUnavailableError):
            tier.get([key])
        srv.refuse_connections = False
        clock.now += 1
        assert tier.get([key]) == [b"h"]
        tier.close()


@pytest.mark.aerospike_emulator(DOWN)
def test_usage_survives_an_outage(server: AerospikeTestServer) -> None:
    tier = make_tier(server, usage_refresh_s=0, max_retries=0)
    tier.put([(os.urandom(16), b"i" * 5000)])
    before = tier.usage()
    assert before.used_bytes > 5000
    server.stop()
    assert tier.usage() == before  # cached, no exception
    tier.close()


def test_closed_tier_is_unavailable(target: Target) -> None:
    tier = make_tier(target)
    tier.close()
    with pytest.raises(TierUnavailableError):
        tier.get([os.urandom(16)])
    tier.close()  # idempotent


def test_cluster_name_is_checked(target: Target) -> None:
    right = make_tier(target, cluster_name=target.cluster_name())
    assert right.put([(os.urandom(16), b"j")]) == [True]
    right.close()
    wrong = make_tier(target, cluster_name="someone-else")  # construction does not raise
    assert wrong.limits is None
    with pytest.raises(TierUnavailableError):
        wrong.put([(os.urandom(16), b"j")])
    wrong.close()
