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
      namespaces:              # shared namespaces (each tenant has its own unless it names one)
        - name: fleet
          trusted_writers: [prefill-a]   # their blocks outrank other writers'; default: every writer
      tenants:
        - name: team-a
          token_sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
          role: writer
        - name: prefill-a            # writes fleet, trusted
          token_sha256: <digest>
          role: writer
          namespace: fleet
        - name: decode-1             # reads fleet: only trusted writers' blocks (reads: trusted)
          token_sha256: <digest>
          role: reader
          namespace: fleet
        - name: ops
          token_sha256: [<current>, <next>]   # several tokens: rotation
          role: admin
      tls:
        cert_file: /etc/kvtier/server.crt
        key_file: /etc/kvtier/server.key

Tokens are configured only as SHA-256 hex digests (``printf %s "$TOKEN" |
sha256sum``); the server never holds a plain token. ``open`` decides whether
a request without a token is served (as tenant ``anonymous``, in a namespace
of its own; role admin only when no tenant is configured, else writer): by
default only when the server is bound to a loopback address. The HTTP
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
    """One tenant: a principal with its token hashes, role and key namespace."""

    name: str = Field(description="1-63 characters of letters, digits, '.', '_', '-'")
    token_sha256: Annotated[list[str], BeforeValidator(_token_list)] = Field(
        min_length=1, description="SHA-256 hex digest of each accepted token (several: rotation)"
    )
    role: Role = "writer"
    namespace: str | None = Field(
        None,
        description="a shared namespace (declared under namespaces) this tenant reads and, "
        "with role writer or admin, writes; null: a namespace of its own, named after it",
    )
    reads: Literal["trusted", "any"] = Field(
        "trusted",
        description="in a namespace with trusted_writers: trusted = only their blocks; "
        "any = theirs first, then other writers' (never for a trusted writer)",
    )
    sees_all_stats: bool = Field(
        False,
        description="Stats, /api/stats and /metrics show every tenant's traffic (admin always "
        "does; others see their own)",
    )

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


class NamespaceConfig(_Strict):
    """A key namespace several tenants share: who is trusted to write it.

    Every tenant whose ``namespace`` names it reads it; those with role
    writer or admin write it. Blocks of ``trusted_writers`` live apart from
    other writers' (a later trusted block is never deduplicated away by an
    earlier untrusted one) and are all that readers with ``reads: trusted``
    (the default) are served.
    """

    name: str = Field(description="1-63 characters of letters, digits, '.', '_', '-'")
    trusted_writers: list[str] | None = Field(
        None, description="tenants whose blocks readers trust; null: every writer of it"
    )

    @model_validator(mode="after")
    def _check(self) -> NamespaceConfig:
        if not _TENANT_NAME.match(self.name):
            raise ValueError(
                f"namespace name {self.name!r} must be 1-63 letters, digits, '.', '_' or '-'"
            )
        if self.name in RESERVED_TENANT_NAMES:
            raise ValueError(f"namespace name {self.name!r} is reserved")
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
    namespaces: list[NamespaceConfig] = Field(default_factory=list)
    provenance_key_file: Path | None = Field(
        None,
        description="a file whose contents (at least 16 bytes) key the provenance stamps of "
        "stored blocks; null: a random key per start (stamps then verify only until a restart)",
    )
    tenant_max_calls: int | None = Field(
        None,
        ge=1,
        description="gRPC calls one tenant may have in flight (more: RESOURCE_EXHAUSTED); "
        "null: half of threads, so one tenant never holds every thread",
    )
    tenant_max_inflight_put_bytes: ByteCount | None = Field(
        None,
        description="block bytes one tenant may be receiving at once, both planes; "
        "null: a quarter of max_inflight_put_bytes (at least max_block_size)",
    )
    stream_idle_timeout_s: float = Field(
        10.0, gt=0, description="a gRPC stream that sends or takes no frame this long is cancelled"
    )
    call_timeout_s: float = Field(
        120.0, gt=0, description="longest any call or data-plane request may take, start to end"
    )
    data_handshake_timeout_s: float = Field(
        3.0, gt=0, description="a data-plane connection must send its handshake within this"
    )
    data_max_pending_per_address: int = Field(
        8,
        ge=1,
        description="silent data-plane connections of one address (pending, and their peer has "
        "sent nothing); one more pending connection closes the oldest silent one. A connection "
        "whose handshake arrived is never closed for this, however long it waits for a thread",
    )
    data_max_pending: int = Field(
        64,
        ge=1,
        description="data-plane connections in their handshake, all addresses; one more closes "
        "the oldest of the address holding the most",
    )
    tenant_max_data_connections: int | None = Field(
        None, ge=1, description="data-plane connections of one tenant; null: a quarter of the cap"
    )
    store_put_wait_s: float = Field(
        10.0,
        ge=0,
        description="a stored block waits this long for room in a lower tier's write queue "
        "before that write is dropped: a flood of puts slows its senders instead of losing "
        "blocks the server acknowledged",
    )
    http_timeout_s: float = Field(
        5.0, gt=0, description="an HTTP request must arrive (and its answer be taken) within this"
    )
    http_max_threads: int = Field(
        32, ge=1, description="HTTP requests served at once; more are closed at once"
    )
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
        self._check_namespaces(names)
        calls = self.tenant_max_calls
        if calls is not None and self.threads > 1 and calls >= self.threads:
            raise ValueError(
                f"tenant_max_calls ({calls}) must be below threads "
                f"({self.threads}), or one tenant can hold every thread"
            )
        per_tenant = self.tenant_max_inflight_put_bytes
        if per_tenant is not None and not (
            self.max_block_size <= per_tenant <= self.max_inflight_put_bytes
        ):
            raise ValueError(
                f"tenant_max_inflight_put_bytes ({per_tenant}) must lie between max_block_size "
                f"({self.max_block_size}) and max_inflight_put_bytes ({self.max_inflight_put_bytes})"
            )
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

    def _check_namespaces(self, tenant_names: list[str]) -> None:
        spaces = {n.name: n for n in self.namespaces}
        if len(spaces) != len(self.namespaces):
            raise ValueError("namespace names must be unique")
        for name in spaces:
            if name in tenant_names:
                raise ValueError(
                    f"namespace {name!r} has the name of a tenant (whose own namespace it is)"
                )
        members: dict[str, dict[str, TenantConfig]] = {n: {} for n in spaces}
        for t in self.tenants:
            if t.namespace is None:
                if t.reads != "trusted":
                    raise ValueError(f"tenant {t.name!r}: reads applies to a shared namespace")
                continue
            if t.namespace not in spaces:
                raise ValueError(
                    f"tenant {t.name!r} names namespace {t.namespace!r}, which is not declared "
                    "under namespaces"
                )
            members[t.namespace][t.name] = t
        for ns in self.namespaces:
            for w in ns.trusted_writers or []:
                member = members[ns.name].get(w)
                if member is None or ROLE_RANK[member.role] < ROLE_RANK["writer"]:
                    raise ValueError(
                        f"namespace {ns.name!r}: trusted writer {w!r} is not a tenant of it "
                        "with role writer or admin"
                    )
                if member.reads == "any":
                    raise ValueError(
                        f"tenant {w!r} is a trusted writer of {ns.name!r}: it reads trusted "
                        "blocks only (drop reads: any)"
                    )

    @property
    def effective_tenant_max_calls(self) -> int:
        """Calls one tenant may have in flight."""
        if self.tenant_max_calls is not None:
            return self.tenant_max_calls
        return max(1, self.threads // 2)

    @property
    def effective_tenant_put_bytes(self) -> int:
        """Block bytes one tenant may be receiving at once."""
        if self.tenant_max_inflight_put_bytes is not None:
            return self.tenant_max_inflight_put_bytes
        return max(self.max_block_size, self.max_inflight_put_bytes // 4)

    @property
    def effective_tenant_data_connections(self) -> int:
        """Data-plane connections one tenant may hold."""
        if self.tenant_max_data_connections is not None:
            return self.tenant_max_data_connections
        return max(1, self.data_max_connections // 4)

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
