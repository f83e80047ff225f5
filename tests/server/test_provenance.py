"""Provenance on the cache server: who may write a namespace, who is trusted, what readers get.

One shared namespace ``fleet`` whose trusted writer is ``alpha`` (a prefill
engine, say); ``mallory`` may write it too but is not trusted; ``reader``
reads it (trusted writers only, the default) and ``curious`` reads it with
``reads: any``. Every block is a valid one bound to its key with a valid
checksum: what tells a poisoned block from a good one is only who wrote it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from kvtier.block import BlockSpec, encode_block
from kvtier.config import CpuTierConfig, KvtierConfig
from kvtier.connectors.verify import ChunkVerifier, Quarantine
from kvtier.errors import AuthError
from kvtier.metrics import StoreMetrics
from kvtier.provenance import stamp, writer_of
from kvtier.server.app import CacheServer
from kvtier.server.tenants import scope_key, tenant_salt, untrusted_salt
from kvtier.server_config import NamespaceConfig, ServerConfig, TenantConfig
from kvtier.store import TieredStore
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.remote import RemoteTier
from tests.kvtier.helpers import FlakyTier
from tests.server.helpers import key, metric, remote, running_server, server_config, sha256

TOKENS = {
    "alpha": "tok-alpha-trusted-writer",
    "mallory": "tok-mallory-untrusted-writer",
    "reader": "tok-reader-trusted-only",
    "curious": "tok-curious-reads-any",
    "ops": "tok-ops-admin-0000",
}

SHAPE = (2, 2, 32, 2, 8)  # [layers, 2, tokens, kv_heads, head_dim]
SPEC = BlockSpec(2, 2, 8, torch.bfloat16)


def kv(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def fleet_tenants() -> tuple[list[TenantConfig], list[NamespaceConfig]]:
    def t(name: str, role: str, **kw: object) -> TenantConfig:
        return TenantConfig(name=name, token_sha256=sha256(TOKENS[name]), role=role, **kw)  # type: ignore[arg-type]

    tenants = [
        t("alpha", "writer", namespace="fleet"),
        t("mallory", "writer", namespace="fleet"),
        t("reader", "reader", namespace="fleet"),
        t("curious", "reader", namespace="fleet", reads="any"),
        t("ops", "admin"),
    ]
    return tenants, [NamespaceConfig(name="fleet", trusted_writers=["alpha"])]


def fleet_config(**kw: object) -> ServerConfig:
    tenants, namespaces = fleet_tenants()
    base: dict[str, object] = {
        "open": False,
        "tenants": tenants,
        "namespaces": namespaces,
        "http_port": None,
    }
    return server_config(**{**base, **kw})


@pytest.fixture
def fleet() -> Iterator[CacheServer]:
    with running_server(fleet_config()) as server:
        yield server


@pytest.fixture
def clients(fleet: CacheServer) -> Iterator[dict[str, RemoteTier]]:
    tiers = {name: remote(fleet, TOKENS[name], retries=0) for name in TOKENS}
    yield tiers
    for tier in tiers.values():
        tier.close()


def test_a_poisoned_block_of_an_untrusted_writer_is_never_served_to_a_trusting_reader(
    fleet: CacheServer, clients: dict[str, RemoteTier]
) -> None:
    k = key(1)
    poison = encode_block(kv(666), key=k)  # wrong KV, right key, valid checksum
    # mallory also claims to be alpha in a trailer of its own: the server re-stamps it
    forged = stamp(poison, writer="alpha", secret=b"mallory-guess" * 3, scope=k)
    assert clients["mallory"].put([(k, forged)]) == [True]
    reader = clients["reader"]
    assert reader.contains([k]) == [False]
    assert reader.prefix_length([k]) == 0
    assert reader.get([k]) == [None]
    # a reader that accepts any writer sees it, as mallory's (the trusted slot is empty)
    assert clients["curious"].get([k]) == [poison]
    # and the trusted writer is not told the key is held: its own put is not deduplicated away
    assert clients["alpha"].contains([k]) == [False]
    # tenants of other namespaces see nothing of the fleet's
    assert clients["ops"].get([k]) == [None]


def test_a_trusted_writers_block_replaces_an_earlier_poisoned_one_for_every_reader(
    fleet: CacheServer, clients: dict[str, RemoteTier]
) -> None:
    k = key(2)
    poison = encode_block(kv(666), key=k)
    good = encode_block(kv(2), key=k)
    assert clients["mallory"].put([(k, poison)]) == [True]
    assert clients["curious"].get([k]) == [poison]
    alpha = clients["alpha"]
    assert alpha.put([(k, good)]) == [True]  # skip_existing is on: it asked Exists first
    assert alpha.skipped_writes == 0
    assert clients["reader"].get([k]) == [good]
    assert clients["curious"].get([k]) == [good]  # the trusted block outranks the earlier one
    # a second put of the same key by mallory does not displace it either
    assert clients["mallory"].put([(k, encode_block(kv(667), key=k))]) == [True]
    assert clients["reader"].get([k]) == [good] and clients["curious"].get([k]) == [good]
    # an untrusted writer cannot delete the trusted block; its delete reaches its own slot only
    assert clients["mallory"].delete([k]) == 1
    assert clients["reader"].get([k]) == [good]


def test_stored_blocks_are_stamped_with_the_writer_the_token_authenticated(
    fleet: CacheServer, clients: dict[str, RemoteTier]
) -> None:
    k = key(3)
    clients["mallory"].put([(k, encode_block(kv(3), key=k))])
    clients["alpha"].put([(k, encode_block(kv(3), key=k))])
    stored = {
        writer_of(b)
        for b in fleet.store.tiers[0].get(
            [scope_key(tenant_salt("fleet"), k), scope_key(untrusted_salt("fleet"), k)]
        )
        if b is not None
    }
    assert stored == {"alpha", "mallory"}


def test_readers_cannot_write_but_may_report_a_bad_block(
    fleet: CacheServer, clients: dict[str, RemoteTier]
) -> None:
    k = key(4)
    reader = clients["reader"]
    assert reader.put([(k, encode_block(kv(4), key=k))]) == [False]  # not sent: a read-only token
    clients["alpha"].put([(k, encode_block(kv(4), key=k))])
    with pytest.raises(AuthError):
        reader.delete([k])
    assert reader.get([k]) != [None]


def test_a_verification_mismatch_deletes_the_block_from_the_shared_tier_and_counts_its_writer(
    fleet: CacheServer, clients: dict[str, RemoteTier]
) -> None:
    wrong, right = key(5), key(6)
    # even a trusted writer can be wrong (a bug, a bad kernel): sampled verification catches it
    clients["alpha"].put([(wrong, encode_block(kv(666), key=wrong))])
    clients["alpha"].put([(right, encode_block(kv(6), key=right))])
    metrics = StoreMetrics()
    reader_tier = remote(fleet, TOKENS["reader"], retries=0, metrics=metrics)
    store = TieredStore([CpuTier(64 << 20, metrics=metrics), reader_tier], metrics=metrics)
    quarantine = Quarantine()
    verifier = ChunkVerifier(
        store, spec=SPEC, quarantine=quarantine, metrics=metrics, max_queue=8, fetch_timeout_s=10
    )
    try:
        assert verifier.submit(wrong, kv(5))  # what the engine computed for that prefix
        assert verifier.submit(right, kv(6))
        assert verifier.flush(30)
        assert (verifier.stats.mismatched, verifier.stats.matched) == (1, 1)
        assert metric(fleet, "kvtier_server_bad_blocks_total", writer="alpha") == 1
        assert metric(fleet, "kvtier_server_bad_block_reports_total", tenant="reader") == 1
        # gone from the tier for everyone, not only quarantined in this process
        assert clients["curious"].get([wrong]) == [None]
        assert clients["reader"].get([right]) != [None]
        assert wrong in quarantine
    finally:
        verifier.close(timeout=10)
        store.close()


class _SharedBackend(FlakyTier):
    """Storage other principals can write (an Aerospike namespace, say): reads not verified."""

    verifies_reads = False


def test_blocks_planted_in_shared_storage_without_the_servers_stamp_are_refused() -> None:
    backend = _SharedBackend("shared")
    store = TieredStore([backend])
    with running_server(fleet_config(), store=store) as server:
        reader = remote(server, TOKENS["reader"], retries=0)
        alpha = remote(server, TOKENS["alpha"], retries=0)
        try:
            k, planted = key(7), key(8)
            good = encode_block(kv(7), key=k)
            alpha.put([(k, good)])
            assert reader.get([k]) == [good]  # the server's own stamp verifies
            scoped = scope_key(tenant_salt("fleet"), planted)
            poison = encode_block(kv(666), key=planted)
            # written straight into the backend: unstamped, then stamped with a guessed key
            for bad in (poison, stamp(poison, writer="alpha", secret=b"x" * 32, scope=scoped)):
                backend.put([(scoped, bad)])
                assert reader.get([planted]) == [None]
                assert scoped not in backend.data  # deleted, not only skipped
            assert metric(server, "kvtier_server_withheld_blocks_total", reason="provenance") == 2
            # a stamped block moved under another key does not verify either
            backend.put([(scoped, backend.data[scope_key(tenant_salt("fleet"), k)])])
            assert reader.get([planted]) == [None]
        finally:
            reader.close()
            alpha.close()


def test_namespace_configuration_is_checked() -> None:
    tenants, namespaces = fleet_tenants()
    with pytest.raises(ValueError, match="not declared under namespaces"):
        ServerConfig(tenants=tenants)
    with pytest.raises(ValueError, match="trusted writer 'reader' is not a tenant of it with role"):
        ServerConfig(
            tenants=tenants, namespaces=[NamespaceConfig(name="fleet", trusted_writers=["reader"])]
        )
    with pytest.raises(ValueError, match="has the name of a tenant"):
        ServerConfig(tenants=tenants, namespaces=[*namespaces, NamespaceConfig(name="ops")])
    bad = [*tenants[:-1], tenants[0].model_copy(update={"name": "x", "reads": "any"})]
    with pytest.raises(ValueError, match="reads trusted blocks only"):
        ServerConfig(
            tenants=bad, namespaces=[NamespaceConfig(name="fleet", trusted_writers=["alpha", "x"])]
        )


def test_without_trusted_writers_every_writer_of_a_namespace_shares_one_slot() -> None:
    tenants, _ = fleet_tenants()
    config = fleet_config(namespaces=[NamespaceConfig(name="fleet")])
    assert [t.name for t in config.tenants] == [t.name for t in tenants]
    store = TieredStore([CpuTier(64 << 20)])
    with running_server(config, store=store) as server:
        mallory = remote(server, TOKENS["mallory"], retries=0)
        reader = remote(server, TOKENS["reader"], retries=0)
        try:
            k = key(9)
            b = encode_block(kv(9), key=k)
            mallory.put([(k, b)])
            assert reader.get([k]) == [b]
        finally:
            mallory.close()
            reader.close()


def test_the_anonymous_caller_is_never_admin_when_tenants_exist() -> None:
    cfg = server_config(open=True, tenants=fleet_tenants()[0], namespaces=fleet_tenants()[1])
    with running_server(cfg, KvtierConfig(tiers=[CpuTierConfig(capacity=64 << 20)])) as server:
        anonymous = remote(server, None, retries=0)
        alpha = remote(server, TOKENS["alpha"], retries=0)
        try:
            health = anonymous.health()
            assert (health.tenant, health.role) == ("anonymous", "writer")
            alpha.put([(key(10), encode_block(kv(10), key=key(10)))])
            deadline = time.monotonic() + 30
            while not [t for t in alpha.server_stats().tenants if t.name == "alpha"]:
                assert time.monotonic() < deadline, "the stats sampler never saw alpha's put"
                time.sleep(0.2)
            seen = {t.name for t in anonymous.server_stats().tenants}
            assert "alpha" not in seen  # no other tenant's traffic
            assert anonymous.get([key(10)]) == [None]  # nor its blocks
        finally:
            anonymous.close()
            alpha.close()
