"""Configuration of the kvtier cache server (:class:`ServerConfig`).

In YAML, the ``server:`` section of the kvtier configuration file (the rest
of the file configures the store the server runs)::

    server:
      host: 0.0.0.0
      port: 50051              # gRPC
      data_port: 50052         # the bulk data plane (Get/Put of block bytes); null: off
      http_port: 9470          # /metrics, /api/stats, the dashboard; null: off
      http_require_token: true # those need a tenant's token (Bearer, or Basic: password)
      http_role: reader        # ... of at least this role (default admin)
      threads: 16
      max_block_size: 64MiB
      tenants:
        - name: team-a
          token_sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
          role: writer
        - name: ops
          token_sha256: [<current>, <next>]   # several tokens: rotation
          role: admin
      tls:
        cert_file: /etc/kvtier/server.crt
        key_file: /etc/kvtier/server.key

Tokens are configured only as SHA-256 hex digests (``printf %s "$TOKEN" |
sha256sum``); the server never holds a plain token. ``open`` decides whether
a request without a token is served (as tenant ``anonymous``, role admin):
by default only when the server is bound to a loopback address. The HTTP
side (``/metrics``, ``/api/stats``, the dashboard) asks for a token only with
``http_require_token``; ``/healthz`` and ``/readyz`` never do.

This module imports neither grpc nor the server, so the top-level
:class:`~kvtier.config.KvtierConfig` can embed :class:`ServerConfig`.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from kvtier.units import parse_bytes

ANONYMOUS_TENANT = "anonymous"
"""The tenant of requests without a token on an open server (a reserved name)."""

OTHER_TENANTS_LABEL = "other"
"""Metrics label of tenants beyond :attr:`ServerConfig.metrics_max_tenants`."""

UNAUTHENTICATED_LABEL = "unauthenticated"
"""Metrics label of requests refused before a tenant was known."""

RESERVED_TENANT_NAMES = frozenset({ANONYMOUS_TENANT, OTHER_TENANTS_LABEL, UNAUTHENTICATED_LABEL})

Role = Literal["reader", "writer", "admin"]
"""``reader``: lookup, exists, get, stats of itself. ``writer``: also put and
delete. ``admin``: also stats of every tenant."""

ROLE_RANK: dict[str, int] = {"reader": 0, "writer": 1, "admin": 2}
"""Each role includes the rights of those ranked below it."""

_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def _bytes(value: Any) -> Any:
    if isinstance(value, int | str) and not isinstance(value, bool):
        return parse_bytes(value)
    return value


ByteCount = Annotated[int, BeforeValidator(_bytes), Field(gt=0)]
"""A positive byte count, written as ``4MiB``, ``512KB`` or an int."""


def _token_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TenantConfig(_Strict):
    """One tenant: a name (its key namespace on the server), its token hashes and role."""

    name: str = Field(description="1-63 characters of letters, digits, '.', '_', '-'")
    token_sha256: Annotated[list[str], BeforeValidator(_token_list)] = Field(
        min_length=1, description="SHA-256 hex digest of each accepted token (several: rotation)"
    )
    role: Role = "writer"

    @model_validator(mode="after")
    def _check(self) -> TenantConfig:
        if not _TENANT_NAME.match(self.name):
            raise ValueError(
                f"tenant name {self.name!r} must be 1-63 letters, digits, '.', '_' or '-'"
            )
        if self.name in RESERVED_TENANT_NAMES:
            raise ValueError(f"tenant name {self.name!r} is reserved")
        for digest in self.token_sha256:
            if not _SHA256_HEX.match(digest):
                raise ValueError(
                    f"tenant {self.name!r}: token_sha256 must be 64 lowercase hex digits "
                    "(the SHA-256 of the token, never the token itself)"
                )
        return self


class TlsConfig(_Strict):
    """Serve gRPC over TLS with this PEM certificate chain and private key."""

    cert_file: Path
    key_file: Path


class ServerConfig(_Strict):
    """The cache server: addresses, threads, limits, tenants, TLS."""

    host: str = Field("127.0.0.1", min_length=1, description="address the servers bind to")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port (0: any free port)")
    data_port: int | None = Field(
        50052,
        ge=0,
        le=65535,
        description="bulk data plane port on the same host (0: any free; null: off); "
        "defaults to 0 when port is 0",
    )
    data_max_connections: int = Field(
        256, ge=1, description="data-plane connections at once; more are refused"
    )
    data_io_timeout_s: float = Field(
        30.0, gt=0, description="longest a data-plane read or write of one request step may take"
    )
    data_idle_timeout_s: float = Field(
        600.0, gt=0, description="data-plane connections idle this long are closed"
    )
    http_port: int | None = Field(
        9470, ge=0, le=65535, description="/metrics and dashboard port (0: any; null: off)"
    )
    http_host: str | None = Field(None, description="bind the HTTP server here instead of host")
    http_require_token: bool = Field(
        False,
        description="/metrics, /api/stats and the dashboard need a tenant's token "
        "('Authorization: Bearer TOKEN', or Basic with the token as password, which browsers "
        "ask for); /healthz and /readyz stay open",
    )
    http_role: Role = Field(
        "admin",
        description="with http_require_token: the least role whose token opens them "
        "(they show every tenant's traffic, as the admin Stats call does)",
    )
    threads: int = Field(16, ge=1, le=1024, description="threads serving gRPC calls")
    max_concurrent_rpcs: int = Field(
        256, ge=1, description="calls beyond this are refused with RESOURCE_EXHAUSTED"
    )
    chunk_size: ByteCount = Field(
        parse_bytes("1MiB"), description="block bytes per streamed frame (both directions)"
    )
    max_message_size: ByteCount = Field(
        parse_bytes("4MiB"), description="largest gRPC message accepted (frames, key lists)"
    )
    max_block_size: ByteCount = Field(
        parse_bytes("64MiB"), description="largest block accepted by Put"
    )
    max_keys_per_call: int = Field(4096, ge=1, description="keys per call, blocks per Put stream")
    max_inflight_put_bytes: ByteCount = Field(
        parse_bytes("1GiB"),
        description="block bytes being received at once, all calls together; "
        "a block beyond it is refused with RESOURCE_EXHAUSTED",
    )
    shutdown_grace_s: float = Field(
        30.0, ge=0, description="on SIGTERM/SIGINT, time given to calls in flight"
    )
    open: bool | None = Field(
        None,
        description="serve requests without a token (as 'anonymous', role admin); "
        "null: only when host is a loopback address",
    )
    tenants: list[TenantConfig] = Field(default_factory=list)
    tls: TlsConfig | None = None
    metrics_max_tenants: int = Field(
        100, ge=1, description="tenants named in metric labels (in config order); the rest: 'other'"
    )
    history_s: int = Field(
        300, ge=10, le=86400, description="seconds of history the dashboard shows"
    )
    malloc_retain: ByteCount | None = Field(
        parse_bytes("1GiB"),
        description="kvtier serve on glibc: keep up to this many freed bytes for reuse "
        "(fewer page faults per transferred block; kvtier/allocator.py); null: allocator defaults",
    )

    @model_validator(mode="before")
    @classmethod
    def _data_port_follows_port(cls, data: Any) -> Any:
        # port 0 (any free port: tests, benchmarks) makes the default data port any free one too
        if isinstance(data, dict) and "data_port" not in data and data.get("port") == 0:
            return {**data, "data_port": 0}
        return data

    @model_validator(mode="after")
    def _check(self) -> ServerConfig:
        names = [t.name for t in self.tenants]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"tenant names must be unique; repeated: {dupes}")
        digests = [d for t in self.tenants for d in t.token_sha256]
        if len(set(digests)) != len(digests):
            raise ValueError("a token hash is listed for more than one tenant")
        if self.chunk_size + 1024 > self.max_message_size:
            raise ValueError(
                f"chunk_size ({self.chunk_size}) plus framing must fit in max_message_size "
                f"({self.max_message_size})"
            )
        if self.max_keys_per_call * 24 + 1024 > self.max_message_size:
            raise ValueError(
                f"max_keys_per_call ({self.max_keys_per_call}) keys must fit in one message "
                f"of max_message_size ({self.max_message_size})"
            )
        if self.max_block_size > self.max_inflight_put_bytes:
            raise ValueError(
                f"max_block_size ({self.max_block_size}) exceeds max_inflight_put_bytes "
                f"({self.max_inflight_put_bytes}): no block that large could ever be received"
            )
        # NOTE: the default itself passes: a dumped configuration must load again
        if self.http_role != "admin" and not self.http_require_token:
            raise ValueError("http_role has no effect without http_require_token: true")
        if self.http_require_token and self.http_port is not None:
            least = ROLE_RANK[self.http_role]
            if not any(ROLE_RANK[t.role] >= least for t in self.tenants):
                raise ValueError(
                    f"http_require_token: no tenant has role {self.http_role} or above, so no "
                    "token could open /metrics or the dashboard (add one, or lower http_role)"
                )
        same_host = (self.http_host or self.host) == self.host
        if self.http_port and self.http_port == self.port and same_host:
            raise ValueError(f"http_port and port are both {self.port}")
        if self.data_port and self.data_port == self.port:
            raise ValueError(f"data_port and port are both {self.port}")
        if self.data_port and self.data_port == self.http_port and same_host:
            raise ValueError(f"data_port and http_port are both {self.data_port}")
        return self

    @property
    def is_open(self) -> bool:
        """Whether requests without a token are served (``open``, else: bound to loopback)."""
        if self.open is not None:
            return self.open
        return is_loopback(self.host)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
