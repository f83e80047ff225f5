"""Shared helpers of the cache server tests: servers on free loopback ports, tokens, blocks."""

from __future__ import annotations

import hashlib
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import grpc
import torch

from kvtier.block import HEADER_SIZE, encode_block
from kvtier.config import CpuTierConfig, KvtierConfig
from kvtier.metrics import StoreMetrics
from kvtier.server.app import CacheServer
from kvtier.server_config import ServerConfig, TenantConfig
from kvtier.store import TieredStore
from kvtier.tiers.remote import RemoteTier
from kvtier.tiers.remote_config import RemoteTierConfig
from kvtier.wire import kvtier_cache_pb2_grpc as pbg
from kvtier.wire.transport import CLIENT_MAX_RECEIVE, channel_options
from tests.kvtier.helpers import block, key

__all__ = ["block", "key"]

TOKENS = {"alpha": "tok-alpha-0123456789", "beta": "tok-beta-9876543210", "ops": "tok-ops-admin"}
"""Plain tokens of the test tenants (the server is configured with their hashes)."""


def sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def tenants(roles: dict[str, str] | None = None) -> list[TenantConfig]:
    """alpha and beta (writers) and ops (admin), unless ``roles`` says otherwise."""
    roles = roles or {"alpha": "writer", "beta": "writer", "ops": "admin"}
    return [
        TenantConfig(name=name, token_sha256=sha256(TOKENS[name]), role=role)  # type: ignore[arg-type]
        for name, role in roles.items()
    ]


def server_config(**kw: Any) -> ServerConfig:
    """Loopback, free ports, small limits unless overridden.

    Every listener binds a free port unless a test names one: the data plane
    too (``data_port: 0``), also when the test fixes the gRPC port (only
    ``port: 0`` makes an unset data port follow; the default 50052 may be
    taken by another server on the host).
    """
    base: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "data_port": 0,
        "http_port": 0,
        "threads": 8,
    }
    base.update(kw)
    return ServerConfig(**base)


def cpu_store_config(capacity: int = 256 << 20) -> KvtierConfig:
    return KvtierConfig(tiers=[CpuTierConfig(capacity=capacity)])


@contextmanager
def running_server(
    config: ServerConfig | None = None,
    store_config: KvtierConfig | None = None,
    *,
    store: TieredStore | None = None,
) -> Iterator[CacheServer]:
    """A started server, stopped (grace 2 s) when the block exits."""
    config = config or server_config()
    if store is None:
        server = CacheServer(config, store_config or cpu_store_config())
    else:
        server = CacheServer(config, store=store)
    server.start()
    try:
        yield server
    finally:
        server.stop(grace=2.0)


def remote(
    server_or_address: CacheServer | str,
    token: str | None = None,
    *,
    metrics: StoreMetrics | None = None,
    **kw: Any,
) -> RemoteTier:
    address = server_or_address if isinstance(server_or_address, str) else server_or_address.address
    return RemoteTier(RemoteTierConfig(address=address, token=token, **kw), metrics=metrics)


def stub(address: str) -> tuple[grpc.Channel, pbg.KvCacheStub]:
    """A channel and the generated (standard protobuf) stub, as any other-language client would use."""
    channel = grpc.insecure_channel(address, options=channel_options(CLIENT_MAX_RECEIVE))
    return channel, pbg.KvCacheStub(channel)


def auth(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def metric(server: CacheServer, name: str, **labels: str) -> float:
    value = server.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def requests_of(server: CacheServer, method: str) -> float:
    """Calls of ``method`` served so far, all tenants and codes."""
    total = 0.0
    for m in server.registry.collect():
        for s in m.samples:
            if s.name == "kvtier_server_requests_total" and s.labels.get("method") == method:
                total += s.value
    return total


def keys(ids: Sequence[int]) -> list[bytes]:
    return [key(i) for i in ids]


def sized_block(i: int, nbytes: int) -> bytes:
    """A valid block of about ``nbytes`` (within 128 bytes), content depending on ``i``, bound to
    ``key(i)``; fast to make."""
    tokens = max(1, (nbytes - HEADER_SIZE) // 128)  # [2 layers, K/V, tokens, 2 heads, 8] bf16
    values = (torch.arange(2 * 2 * tokens * 2 * 8, dtype=torch.int32) * (2 * i + 1)) % 251
    return encode_block(values.to(torch.bfloat16).view(2, 2, tokens, 2, 8), key=key(i))


def wait_until(predicate: Any, what: str, timeout: float = 10.0) -> None:
    """Poll ``predicate`` until true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout} s"
        time.sleep(0.02)
