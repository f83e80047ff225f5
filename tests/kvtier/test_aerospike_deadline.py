"""The Aerospike tier's read deadline: one instant bounds a whole get, retries and segments included.

The emulator stalls like a paused (SIGSTOPped) server, on a chosen request:
requests arrive and are not answered for seconds (a real cluster with a
paused node: tests/kvtier/test_aerospike_cluster.py). Bounds are generous
(deadline + 1 s) so a loaded host passes; what they rule out is the
configured timeouts and retries running on past the deadline (seconds).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import pytest

from kvtier.breaker import BreakerState
from kvtier.errors import DeadlineExceededError, TransientError
from kvtier.store import TieredStore
from kvtier.tiers.aerospike import AerospikeTier
from kvtier.tiers.aerospike_config import AerospikeTierConfig
from kvtier.tiers.cpu import CpuTier
from tests.support.aerospike_server import AerospikeTestServer, NamespaceConfig
from tests.support.aerospike_target import make_target
from tests.support.timeouts import aerospike_timeouts, scaled

STALL = (
    "a chosen stall: replies held for seconds (a paused real node is in test_aerospike_cluster.py)"
)

KiB, MiB = 1024, 1024 * 1024
SLACK = scaled(0.25)
"""How late a call may return after its deadline here (1 s by default: a loaded 2-core host)."""


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def server() -> Iterator[AerospikeTestServer]:
    # Small records, so a few MiB are a segmented block.
    with AerospikeTestServer([NamespaceConfig(max_record_size=128 * KiB)]) as srv:
        yield srv


def make_tier(address: str, clock: FakeClock | None = None, **overrides: object) -> AerospikeTier:
    overrides.setdefault("retry_backoff_ms", 1)
    overrides.setdefault("retry_backoff_cap_ms", 2)
    for name, value in aerospike_timeouts().items():  # tests of timeouts set their own
        overrides.setdefault(name, value)
    cfg = AerospikeTierConfig(hosts=[address], **overrides)  # type: ignore[arg-type]
    return AerospikeTier(cfg) if clock is None else AerospikeTier(cfg, clock=clock)


def stall(server: AerospikeTestServer, segmented: bool, seconds: float) -> None:
    """Stall every read (single record), or every segment batch after the chunk-key read."""
    if segmented:
        server.delay_next(seconds, count=100, skip=1)
    else:
        server.latency = seconds


@pytest.mark.aerospike_emulator(STALL)
@pytest.mark.parametrize("segmented", [False, True], ids=["single-record", "segmented"])
def test_stalled_server_get_returns_by_the_deadline(
    server: AerospikeTestServer, segmented: bool
) -> None:
    # Configured timeouts and retries far beyond the deadline: the deadline must win.
    writer = make_tier(server.address)
    key = os.urandom(16)
    value = os.urandom(4 * MiB) if segmented else b"a" * 1000
    assert writer.put([(key, value)]) == [True]
    assert writer.stats().segmented_writes == int(segmented)
    writer.close()
    # Another engine's tier: it reads the chunk key, then the segments (stalled).
    tier = make_tier(server.address, total_timeout_ms=3000, socket_timeout_ms=3000, max_retries=3)
    before = tier.stats()
    stall(server, segmented, 5.0)
    start = time.monotonic()
    with pytest.raises(TransientError):
        tier.get([key], deadline=start + 0.5)
    took = time.monotonic() - start
    assert 0.4 <= took <= 0.5 + SLACK
    after = tier.stats()
    # one attempt of each round trip it needed; the deadline left no room for a retry
    assert after.round_trips - before.round_trips == (2 if segmented else 1)
    assert after.retries == before.retries
    tier.close()


@pytest.mark.aerospike_emulator(STALL)
@pytest.mark.parametrize("segmented", [False, True], ids=["single-record", "segmented"])
def test_store_over_a_stalled_server_misses_by_the_deadline(
    server: AerospikeTestServer, segmented: bool
) -> None:
    writer = make_tier(server.address)
    key = os.urandom(16)
    writer.put([(key, os.urandom(3 * MiB) if segmented else b"b" * 1000)])
    writer.close()
    # Another engine's tier: it reads the chunk key, then the segments (stalled).
    tier = make_tier(server.address, total_timeout_ms=3000, socket_timeout_ms=3000, max_retries=3)
    with TieredStore([CpuTier(64 * MiB), tier]) as store:
        stall(server, segmented, 5.0)
        start = time.monotonic()
        assert store.get([key], deadline=start + 0.5) == [None]
        assert time.monotonic() - start <= 0.5 + SLACK
        errors = {"tier": "aerospike", "kind": "transient"}
        assert store.metrics.value("kvtier_tier_errors_total", errors) == 1
        server.clear_faults()


@pytest.mark.aerospike_emulator(STALL)
def test_retries_stop_when_the_deadline_cannot_fit_another(server: AerospikeTestServer) -> None:
    tier = make_tier(server.address, total_timeout_ms=200, socket_timeout_ms=200, max_retries=5)
    key = os.urandom(16)
    tier.put([(key, b"c" * 100)])
    server.latency = 5.0
    start = time.monotonic()
    with pytest.raises(TransientError):
        tier.get([key], deadline=start + 0.5)
    assert time.monotonic() - start <= 0.5 + SLACK
    # attempts of 0.2 s, 0.2 s and what is left: 1 or 2 retries of the 5 configured
    assert 1 <= tier.stats().retries <= 2
    # without a deadline the same call uses every retry
    before = tier.stats().retries
    with pytest.raises(TransientError):
        tier.get([key])
    assert tier.stats().retries - before == 5
    tier.close()


@pytest.mark.aerospike_emulator(STALL)
def test_every_segment_batch_shares_the_one_deadline(server: AerospikeTestServer) -> None:
    # 8 rows per batch: a 4 MiB block (34 segments) is read in 5 segment round trips.
    tier = make_tier(server.address, max_batch_keys=8, max_retries=2)
    key, value = os.urandom(16), os.urandom(4 * MiB)
    tier.put([(key, value)])
    # Each segment batch takes 0.25 s, well within its own 1 s timeout ...
    server.delay_next(0.25, count=5, skip=1)
    assert tier.get([key]) == [value]  # ... so without a deadline the get succeeds (~1.25 s)
    before = tier.stats().round_trips
    server.delay_next(0.25, count=100, skip=1)
    start = time.monotonic()
    with pytest.raises(TransientError):
        tier.get([key], deadline=start + 0.6)  # ... but not all of them fit in 0.6 s
    assert time.monotonic() - start <= 0.6 + SLACK
    assert tier.stats().round_trips - before <= 1 + 3  # chunk keys + the batches that fit
    tier.close()


@pytest.mark.aerospike_emulator(STALL)
def test_a_deadline_never_lengthens_the_configured_timeouts(server: AerospikeTestServer) -> None:
    tier = make_tier(server.address, total_timeout_ms=200, socket_timeout_ms=200, max_retries=1)
    key = os.urandom(16)
    tier.put([(key, b"d" * 100)])
    server.latency = 5.0
    start = time.monotonic()
    with pytest.raises(TransientError):
        tier.get([key], deadline=start + 30)
    assert time.monotonic() - start <= 0.4 + SLACK  # two attempts of 0.2 s, not 30 s
    assert tier.stats().retries == 1
    tier.close()


def test_a_past_deadline_raises_without_io() -> None:
    target = make_target()
    tier = make_tier(
        target.address, breaker_threshold=1, namespace=target.namespace, set_name=target.set_name
    )
    key = os.urandom(16)
    tier.put([(key, b"e" * 100)])
    before = tier.stats().round_trips
    past = time.monotonic()
    with pytest.raises(DeadlineExceededError):
        tier.get([key], deadline=past)
    with pytest.raises(DeadlineExceededError):
        tier.contains([key], deadline=past)
    with pytest.raises(DeadlineExceededError):
        tier.prefix_length([key], deadline=past)
    stats = tier.stats()
    assert stats.round_trips == before and stats.deadline_skips == 3
    # the caller's lateness says nothing about the cluster: the breaker did not count it
    assert tier.breaker.state is BreakerState.CLOSED and tier.breaker.consecutive_failures == 0
    assert tier.get([key], deadline=time.monotonic() + 5) == [b"e" * 100]
    assert tier.contains([key], deadline=time.monotonic() + 5) == [True]
    tier.close()
    target.close()


def test_connecting_is_waited_for_only_until_the_deadline() -> None:
    # A listener that never answers: TCP connects, the client's info request hangs.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        clock = FakeClock()
        tier = make_tier(
            f"127.0.0.1:{silent.getsockname()[1]}",
            clock,
            connect_timeout_ms=1500,
            breaker_cooldown_s=1,
        )
        assert tier.limits is None and tier.breaker.state is BreakerState.OPEN
        clock.now += 1  # the cool-down is over: the next call is the probe and connects
        start = time.monotonic()
        with pytest.raises(DeadlineExceededError, match="connecting"):
            tier.get([os.urandom(16)], deadline=start + 0.3)
        assert time.monotonic() - start <= 0.3 + SLACK  # not the 1.5 s connect timeout
        assert tier.stats().deadline_skips == 1 and tier.stats().transient_errors == 0
        tier.close()  # waits for the background connect attempt to give up


@pytest.mark.aerospike_emulator("a server that starts on a chosen port after its client")
def test_a_probe_with_a_deadline_connects_in_the_background() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    clock = FakeClock()
    tier = make_tier(f"127.0.0.1:{port}", clock, breaker_cooldown_s=1)  # nobody listens yet
    assert tier.limits is None
    with AerospikeTestServer(port=port) as srv:
        clock.now += 1
        assert tier.get([os.urandom(16)], deadline=time.monotonic() + 10) == [None]
        assert tier.limits is not None and srv.message_count() == 1
        assert tier.breaker.state is BreakerState.CLOSED
    tier.close()
