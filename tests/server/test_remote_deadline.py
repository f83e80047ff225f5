"""The remote tier's read deadline, over the data plane and over gRPC, against a stalling server.

The server's store hangs in ``get``/``contains`` (a
:class:`~tests.kvtier.helpers.StallingTier`), as a server whose backend is
paused would. Bounds are generous (deadline + 1 s) so a loaded host passes;
what they rule out is the configured 10 s transfer timeout and the retries
running on past the deadline.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvtier.errors import DeadlineExceededError, TransientError
from kvtier.server.app import CacheServer
from kvtier.store import TieredStore
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.remote import RemoteTier
from tests.kvtier.helpers import StallingTier
from tests.server.helpers import (
    block,
    key,
    keys,
    remote,
    requests_of,
    running_server,
    server_config,
)

SLACK = 1.0
"""How late a call may return after its deadline here (a loaded 2-core host)."""
N = 32
"""Keys per get: two of the server's batches of 16 store reads."""

PLANES = pytest.mark.parametrize("data_plane", [True, False], ids=["data-plane", "grpc"])


@pytest.fixture
def stalling() -> Iterator[tuple[CacheServer, StallingTier]]:
    backend = StallingTier("backend", stall_s=10.0)
    with running_server(server_config(http_port=None), store=TieredStore([backend])) as server:
        try:
            yield server, backend
        finally:
            backend.release()  # no handler may still hang when the server stops


def patient(server: CacheServer, **kw: Any) -> RemoteTier:
    """A remote tier whose configured timeouts and retries reach far past the deadlines used."""
    kw.setdefault("timeout_s", 10.0)
    kw.setdefault("transfer_timeout_s", 10.0)
    kw.setdefault("retries", 3)
    kw.setdefault("retry_backoff_s", 0.001)
    kw.setdefault("breaker_failures", 100)
    tier = remote(server, **kw)
    tier.limits()  # Health now, not inside the timed calls
    return tier


def stored(server: CacheServer, backend: StallingTier, tier: RemoteTier, n: int = N) -> None:
    assert tier.put([(key(i), block(i)) for i in range(n)]) == [True] * n
    assert server.store.flush(10)
    assert len(backend.data) == n


@PLANES
def test_stalled_get_returns_by_the_deadline_mid_stream(
    stalling: tuple[CacheServer, StallingTier], data_plane: bool
) -> None:
    server, backend = stalling
    tier = patient(server, data_plane=data_plane)
    stored(server, backend, tier)
    assert tier.get(keys(range(N))) == [block(i) for i in range(N)]
    gets = backend.calls.count("get")
    backend.stall(after=1)  # the first 16 blocks are streamed, then the server hangs
    start = time.monotonic()
    with pytest.raises(TransientError):
        tier.get(keys(range(N)), deadline=start + 0.5)
    took = time.monotonic() - start
    assert 0.4 <= took <= 0.5 + SLACK
    assert backend.calls.count("get") - gets == 2  # one attempt (two store reads), no retry
    t = tier.transport()
    assert t.fallbacks == 0  # a stall on the data plane is no reason to switch planes
    assert t.grpc_gets == (0 if data_plane else 2)  # the first (unstalled) get, then one attempt
    tier.close()


@PLANES
def test_retries_fit_in_the_deadline(
    stalling: tuple[CacheServer, StallingTier], data_plane: bool
) -> None:
    server, backend = stalling
    tier = patient(server, data_plane=data_plane, transfer_timeout_s=0.2, retries=5)
    backend.stall()
    start = time.monotonic()
    with pytest.raises(TransientError):
        tier.get([key(1)], deadline=start + 0.5)
    assert time.monotonic() - start <= 0.5 + SLACK
    # attempts of 0.2 s, 0.2 s and what is left: 2 or 3 of the 6 configured
    assert 2 <= backend.calls.count("get") <= 3
    tier.close()


def test_store_over_a_stalled_server_misses_by_the_deadline(
    stalling: tuple[CacheServer, StallingTier],
) -> None:
    server, backend = stalling
    tier = patient(server)
    stored(server, backend, tier)
    with TieredStore([CpuTier(64 << 20), tier]) as store:
        backend.stall()
        start = time.monotonic()
        assert store.get(keys(range(N)), deadline=start + 0.5) == [None] * N
        assert store.lookup(keys(range(N)), deadline=time.monotonic() + 0.5) == 0
        assert time.monotonic() - start <= 1.0 + 2 * SLACK
        errors = {"tier": "remote", "kind": "transient"}
        assert store.metrics.value("kvtier_tier_errors_total", errors) == 2


def test_stalled_exists_and_lookup_return_by_the_deadline(
    stalling: tuple[CacheServer, StallingTier],
) -> None:
    server, backend = stalling
    tier = patient(server)
    backend.stall()
    for call in (tier.contains, tier.prefix_length):
        start = time.monotonic()
        with pytest.raises(TransientError):
            call(keys(range(4)), deadline=start + 0.5)
        assert time.monotonic() - start <= 0.5 + SLACK  # not the configured 10 s
    tier.close()


def test_gRPC_fallback_shares_the_deadline_of_the_data_plane() -> None:
    # The advertised data plane is replaced by a port that accepts and never answers.
    with socket.socket() as silent, running_server(server_config(http_port=None)) as server:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        writer = remote(server)
        writer.put([(key(i), block(i)) for i in range(4)])
        writer.close()
        tier = remote(
            server,
            data_address=f"127.0.0.1:{silent.getsockname()[1]}",
            timeout_s=5.0,
            retries=3,
        )
        tier.limits()
        start = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            tier.get(keys(range(4)), deadline=start + 0.5)
        assert time.monotonic() - start <= 0.5 + SLACK  # not the 5 s handshake timeout
        assert tier.transport().fallbacks >= 1
        assert tier.breaker.consecutive_failures == 0  # lateness is not the server's failure
        # the data plane now cools down; gRPC serves within the next deadline
        assert tier.get(keys(range(4)), deadline=time.monotonic() + 5) == [
            block(i) for i in range(4)
        ]
        tier.close()


def test_a_past_deadline_raises_without_io() -> None:
    with running_server(server_config(http_port=None)) as server:
        tier = remote(server)
        tier.put([(key(1), block(1))])
        calls = {m: requests_of(server, m) for m in ("Health", "Get", "Exists", "Lookup")}
        past = time.monotonic()
        for call in (tier.get, tier.contains, tier.prefix_length):
            with pytest.raises(DeadlineExceededError):
                call([key(1)], deadline=past)
        assert {m: requests_of(server, m) for m in calls} == calls
        assert tier.breaker.state.value == "closed" and tier.breaker.consecutive_failures == 0
        assert tier.get([key(1)], deadline=time.monotonic() + 5) == [block(1)]
        tier.close()
