"""The remote tier against a live server: round trips, batching, retries, timeouts, breaker, auth, TLS."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from kvtier.block import TRAILER_SIZE
from kvtier.errors import AuthError, ConfigError, TierUnavailableError, TransientError
from kvtier.server_config import TlsConfig
from kvtier.store import TieredStore
from kvtier.tiers.base import Tier
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.remote_config import RemoteTierConfig
from kvtier.tiers.remote_errors import RemoteAuthError, RemoteRetryableError
from tests.kvtier.helpers import FlakyTier
from tests.server.helpers import (
    TOKENS,
    block,
    free_port,
    key,
    keys,
    metric,
    remote,
    requests_of,
    running_server,
    server_config,
    tenants,
)


@pytest.mark.parametrize("data_plane", [True, False], ids=["data-plane", "grpc"])
def test_round_trip_and_the_tier_contract(data_plane: bool) -> None:
    with running_server() as server:
        tier = remote(server, data_plane=data_plane)
        assert isinstance(tier, Tier) and not tier.verifies_reads and not tier.fast
        items = [(key(i), block(i, tokens=100 + i)) for i in range(6)]
        assert tier.put(items) == [True] * 6
        ks = keys(range(8))
        assert tier.contains(ks) == [True] * 6 + [False] * 2
        assert tier.get(ks) == [b for _, b in items] + [None, None]
        assert tier.prefix_length(ks) == 6
        assert tier.delete([key(0), key(7)]) == 1
        assert tier.prefix_length(ks) == 0
        assert tier.get([]) == [] and tier.contains([]) == [] and tier.put([]) == []
        assert tier.prefix_length([]) == 0 and tier.delete([]) == 0
        # the server stores each block with its provenance stamp (kvtier/provenance.py)
        assert tier.usage().used_bytes == sum(len(b) + TRAILER_SIZE for _, b in items[1:])
        t = tier.transport()
        assert (t.data_gets > 0, t.grpc_gets > 0) == (data_plane, not data_plane)
        assert (t.data_puts, t.grpc_puts) == ((1, 0) if data_plane else (0, 1))
        tier.close()


def test_prefix_length_is_one_call_per_batch_of_keys() -> None:
    with running_server(server_config(max_keys_per_call=8, http_port=None)) as server:
        tier = remote(server)
        tier.put([(key(i), block(i)) for i in range(20)])
        before = requests_of(server, "Lookup")
        assert tier.prefix_length(keys(range(8))) == 8
        assert requests_of(server, "Lookup") == before + 1
        assert tier.prefix_length(keys([*range(5), 99, *range(6, 8)])) == 5
        assert requests_of(server, "Lookup") == before + 2
        # 24 keys, 20 present: three batches of 8 (stops inside the third)
        assert tier.prefix_length(keys(range(24))) == 20
        assert requests_of(server, "Lookup") == before + 5
        # a miss inside the first batch ends it there: one call
        assert tier.prefix_length(keys([0, 1, 99, *range(3, 24)])) == 2
        assert requests_of(server, "Lookup") == before + 6
        # other calls split at the server's limit too
        assert tier.contains(keys(range(20))) == [True] * 20
        assert tier.get(keys(range(20))) == [block(i) for i in range(20)]
        assert tier.delete(keys(range(20))) == 20
        tier.close()


def test_put_skips_blocks_the_server_has_and_refuses_oversized_ones() -> None:
    with running_server(server_config(max_block_size=64 * 1024, http_port=None)) as server:
        tier = remote(server)
        small, big = block(1, tokens=10), block(2, tokens=1000)
        assert len(big) > 64 * 1024
        assert tier.put([(key(1), small), (key(2), big)]) == [True, False]
        bytes_in = metric(
            server, "kvtier_server_block_bytes_total", tenant="anonymous", direction="in"
        )
        assert bytes_in == len(small)
        assert tier.put([(key(1), small)]) == [True]
        assert (
            metric(server, "kvtier_server_block_bytes_total", tenant="anonymous", direction="in")
            == bytes_in
        )
        tier.close()


@pytest.mark.parametrize("data_plane", [True, False], ids=["data-plane", "grpc"])
def test_large_blocks_stream_in_frames(data_plane: bool) -> None:
    with running_server(
        server_config(chunk_size=256 * 1024, max_message_size=1 << 20, http_port=None)
    ) as server:
        tier = remote(server, put_batch_bytes=4 << 20, data_plane=data_plane)
        items = [(key(i), block(i, tokens=40_000)) for i in range(3)]  # ~5 MiB each
        assert tier.put(items) == [True] * 3
        assert tier.get([k for k, _ in items]) == [b for _, b in items]
        t = tier.transport()
        # one put per batch of put_batch_bytes (each ~5 MiB block alone), one get
        assert (t.data_puts, t.data_gets) == ((3, 1) if data_plane else (0, 0))
        assert (t.grpc_puts, t.grpc_gets) == ((0, 0) if data_plane else (3, 1))
        tier.close()


def test_store_with_a_remote_tier_promotes_and_survives_engine_restarts() -> None:
    with running_server() as server:
        engine1 = TieredStore([CpuTier(1 << 26), remote(server)])
        items = [(key(i), block(i)) for i in range(10)]
        engine1.put(items)
        assert engine1.flush(timeout=10)
        engine1.close()
        # a second engine with a cold CPU tier finds everything on the server
        engine2 = TieredStore([CpuTier(1 << 26), remote(server)])
        assert engine2.lookup(keys(range(12))) == 10
        assert engine2.get(keys(range(10))) == [b for _, b in items]
        assert engine2.tiers[0].contains(keys(range(10))) == [True] * 10  # promoted
        engine2.close()


def _wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_empty_calls_never_touch_the_network() -> None:
    tier = remote(f"127.0.0.1:{free_port()}", retries=0, breaker_failures=1)  # nobody listens
    assert tier.get([]) == [] and tier.contains([]) == [] and tier.put([]) == []
    assert tier.prefix_length([]) == 0 and tier.delete([]) == 0
    assert tier.breaker.state.value == "closed"
    tier.close()


def test_breaker_opens_while_the_server_is_down_and_recovers_when_it_returns() -> None:
    port = free_port()
    cfg = server_config(port=port, http_port=None)
    tier = remote(
        f"127.0.0.1:{port}", retries=0, timeout_s=0.5, breaker_failures=2, breaker_reset_s=0.5
    )
    with running_server(cfg):
        tier.put([(key(1), block(1))])
        assert tier.prefix_length([key(1)]) == 1
    # down: two transient failures, then fast failures without touching the network
    for _ in range(2):
        with pytest.raises(TransientError) as e:
            tier.contains([key(1)])
        assert not isinstance(e.value, TierUnavailableError)
    assert tier.breaker.state.value == "open"
    with pytest.raises(TierUnavailableError, match="circuit breaker open"):
        tier.get([key(1)])
    # a store treats the dead tier as a miss and counts it
    store = TieredStore([CpuTier(1 << 20), tier])
    assert store.lookup([key(1)]) == 0
    assert (
        store.metrics.value("kvtier_tier_errors_total", {"tier": "remote", "kind": "unavailable"})
        == 1
    )
    # back (empty: a new process): the next probe after the cool-down closes the breaker
    with running_server(cfg):

        def probe_ok() -> bool:
            try:
                return tier.prefix_length([key(1)]) == 0
            except TransientError:
                return False

        _wait_until(probe_ok)
        assert tier.breaker.state.value == "closed"
        assert tier.put([(key(2), block(2))]) == [True]
        assert tier.get([key(2)]) == [block(2)]
    tier.close()


def test_timeouts_are_transient_and_retried_a_bounded_number_of_times() -> None:
    slow = FlakyTier("slow", delay=1.0)
    store = TieredStore([slow])
    with running_server(server_config(http_port=None), store=store) as server:
        tier = remote(server, timeout_s=0.2, retries=2, retry_backoff_s=0.01, breaker_failures=10)
        tier.limits()  # Health does not touch the store
        before = requests_of(server, "Exists")
        with pytest.raises(RemoteRetryableError) as e:
            tier.contains([key(1)])
        assert "DEADLINE_EXCEEDED" in str(e.value)
        # three attempts (the first and two retries), each cut short by its deadline
        _wait_until(lambda: requests_of(server, "Exists") == before + 3)
        assert slow.calls.count("contains") == 3
        assert tier.breaker.consecutive_failures == 1  # one logical call failed
        tier.close()


def test_auth_errors_are_not_retried_and_do_not_open_the_breaker() -> None:
    cfg = server_config(open=False, http_port=None, tenants=tenants())
    with running_server(cfg) as server:
        wrong = remote(server, token="wrong-token", breaker_failures=2)
        for _ in range(4):
            with pytest.raises(RemoteAuthError) as e:
                wrong.contains([key(1)])
            assert isinstance(e.value, AuthError) and isinstance(e.value, ConfigError)
        assert wrong.breaker.state.value == "closed"
        assert requests_of(server, "Health") == 4  # once per call, never retried
        anonymous = remote(server)
        with pytest.raises(RemoteAuthError, match="needs a token"):
            anonymous.get([key(1)])
        right = remote(server, token=TOKENS["alpha"])
        assert right.put([(key(1), block(1))]) == [True]
        assert right.health().tenant == "alpha"
        for t in (wrong, anonymous, right):
            t.close()


def test_token_from_the_environment() -> None:
    cfg = server_config(open=False, http_port=None, tenants=tenants())
    with running_server(cfg) as server:
        conf = RemoteTierConfig(address=server.address, token_env="MY_KV_TOKEN")
        tier = RemoteTier(conf, env={"MY_KV_TOKEN": TOKENS["beta"]})
        assert tier.health().tenant == "beta"
        tier.close()
        with pytest.raises(ConfigError, match="MY_KV_TOKEN is not set"):
            RemoteTier(conf, env={})


def test_remote_config_is_strict() -> None:
    with pytest.raises(ValueError, match="not both"):
        RemoteTierConfig(token="a", token_env="B")
    with pytest.raises(ValueError, match="host:port"):
        RemoteTierConfig(address="no-port")
    with pytest.raises(ValueError, match="Extra inputs"):
        RemoteTierConfig.model_validate({"type": "remote", "adress": "x:1"})
    assert "secret" not in RemoteTierConfig(token="secret").model_dump_json()


def _self_signed(tmp: Path) -> tuple[Path, Path] | None:
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    cert, key_file = tmp / "server.crt", tmp / "server.key"
    subprocess.run(
        [
            openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout", str(key_file), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    return cert, key_file


def test_tls_with_a_self_signed_certificate(tmp_path: Path) -> None:
    files = _self_signed(tmp_path)
    if files is None:
        pytest.skip("needs the openssl command to make a self-signed certificate")
    cert, key_file = files
    cfg = server_config(http_port=None, tls=TlsConfig(cert_file=cert, key_file=key_file))
    with running_server(cfg) as server:
        tier = remote(server, ca_file=cert)
        assert tier.put([(key(1), block(1))]) == [True]
        assert tier.get([key(1)]) == [block(1)]
        tier.close()
        # a plaintext client cannot talk to a TLS server; nor can one that does not trust the cert
        for kw in ({}, {"tls": True}):
            other = remote(server, retries=0, timeout_s=2, **kw)
            with pytest.raises(TransientError):
                other.contains([key(1)])
            other.close()
