"""Tenants: who a caller is (bearer token → tenant), the key namespace and trust of each.

A token is never stored: the configuration holds SHA-256 digests, and a
caller's token is hashed and looked up. (Hashing first also means the lookup
time says nothing about how close a wrong token was.)

**Isolation.** Every key a tenant sends is mapped to a server-side key
``SHA-256(salt ‖ key)[:16]`` with a salt derived from the tenant's name,
before it reaches the store. Two tenants asking for the same 16 bytes address
different blocks, so neither can read, detect (lookup/exists) or delete the
other's blocks; the mapping is stable across restarts (the disk tier keeps a
tenant's blocks) and costs one 32-byte hash per key. It is a cryptographic
hash because tenants choose its input: with a fast non-cryptographic one, a
tenant could search for a key of its own that lands on another tenant's
scoped key (docs/security.md).

**Shared namespaces and trust.** Tenants that name one shared namespace
(``server.namespaces``) scope their keys with that namespace's salt. When
the namespace lists ``trusted_writers``, the blocks of the other writers go
to a second *slot* (another salt): a trusted writer's block never shares a
key with an untrusted one, so dedup can never keep an earlier untrusted
block in place of a later trusted one, and a reader that accepts trusted
writers only never even looks in the other slot::

    slot        salt                         written by           read by
    trusted     tenant_salt(ns)              trusted writers      everyone in ns
    untrusted   tenant_salt(ns ‖ 0 ‖ "u")    the other writers    reads: any (after trusted)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvtier.server_config import (
    ANONYMOUS_TENANT,
    OTHER_TENANTS_LABEL,
    ROLE_RANK,
    Role,
    ServerConfig,
    TenantConfig,
)

_SALT_DOMAIN = b"kvtier-server-tenant-v1\0"


@dataclass(frozen=True)
class Tenant:
    """An authenticated caller.

    Attributes:
        name: The configured name (``anonymous`` on an open server without a token).
        role: What it may do.
        label: Its value of the bounded ``tenant`` metrics label.
        salt: 16 bytes that scope its keys.
    """

    name: str
    role: Role
    label: str
    salt: bytes
    namespace: str = ""
    read_salts: tuple[bytes, ...] = ()
    trusted_writers: frozenset[str] | None = None
    sees_all_stats: bool = False

    def __post_init__(self) -> None:
        if not self.namespace:
            object.__setattr__(self, "namespace", self.name)
        if not self.read_salts:
            object.__setattr__(self, "read_salts", (self.salt,))

    def may(self, role: Role) -> bool:
        """Whether this tenant's role includes ``role``."""
        return ROLE_RANK[self.role] >= ROLE_RANK[role]

    def scope(self, keys: Sequence[bytes]) -> list[bytes]:
        """The server-side keys this tenant writes ``keys`` under (each 16 bytes)."""
        return [scope_key(self.salt, k) for k in keys]

    def read_scopes(self, keys: Sequence[bytes]) -> list[list[bytes]]:
        """The server-side keys of ``keys`` in each slot this tenant reads, most trusted first."""
        return [[scope_key(salt, k) for k in keys] for salt in self.read_salts]

    def accepts(self, writer: str | None) -> bool:
        """Whether a block stamped by ``writer`` (``None``: unstamped) may be served to this tenant."""
        if self.trusted_writers is None:
            return True
        return writer is not None and writer in self.trusted_writers

    @property
    def sees_everyone(self) -> bool:
        """Whether stats show this tenant every tenant's traffic."""
        return self.sees_all_stats or self.may("admin")


def scope_key(salt: bytes, key: bytes) -> bytes:
    """The server-side key of a tenant's ``key`` (16 bytes)."""
    return hashlib.sha256(salt + key).digest()[:16]


def tenant_salt(name: str) -> bytes:
    """The 16-byte key salt of a tenant name (the name of its own namespace)."""
    return xxhash.xxh3_128_digest(_SALT_DOMAIN + name.encode())


def untrusted_salt(namespace: str) -> bytes:
    """The salt of a namespace's slot for writers outside its ``trusted_writers``."""
    # NOTE: names cannot hold a NUL byte (validated), so this salt is no name's own
    return tenant_salt(namespace + "\0untrusted")


class UnknownTokenError(Exception):
    """The presented token matches no tenant."""


class TenantDirectory:
    """Maps bearer tokens to :class:`Tenant` objects; immutable after construction.

    Args:
        config: Tenants, roles and whether the server is open.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.open = config.is_open
        self._by_digest: dict[str, Tenant] = {}
        self.tenants: list[Tenant] = []
        trusted = {ns.name: ns.trusted_writers for ns in config.namespaces}
        for i, tc in enumerate(config.tenants):
            label = tc.name if i < config.metrics_max_tenants else OTHER_TENANTS_LABEL
            tenant = _tenant(tc, label, trusted)
            self.tenants.append(tenant)
            for digest in tc.token_sha256:
                self._by_digest[digest] = tenant
        self._labels = {t.name: t.label for t in self.tenants}
        # NOTE: never admin once tenants exist: an open server (loopback by default) would
        # otherwise show anyone who reaches it every tenant's traffic.
        self.anonymous = Tenant(
            ANONYMOUS_TENANT,
            "writer" if config.tenants else "admin",
            ANONYMOUS_TENANT,
            tenant_salt(ANONYMOUS_TENANT),
        )

    def label_of(self, name: str | None) -> str:
        """The bounded metrics label of a tenant name (``unknown``: none or not a tenant)."""
        if name is None:
            return "unknown"
        if name == ANONYMOUS_TENANT and self.open:
            return ANONYMOUS_TENANT
        return self._labels.get(name, "unknown")

    def by_token(self, token: str | None) -> Tenant | None:
        """The tenant of ``token``.

        Returns:
            The tenant; the anonymous tenant for ``None`` on an open server;
            ``None`` for ``None`` on a closed server (unauthenticated).

        Raises:
            UnknownTokenError: a token was given and matches no tenant (even on
                an open server: a wrong token is a mistake worth reporting).
        """
        if token is None:
            return self.anonymous if self.open else None
        tenant = self._by_digest.get(hashlib.sha256(token.encode()).hexdigest())
        if tenant is None:
            raise UnknownTokenError("the bearer token matches no tenant")
        return tenant

    def labels(self) -> list[str]:
        """Every value the tenant metrics label can take for a known tenant."""
        out = [t.label for t in self.tenants]
        if self.open:
            out.append(ANONYMOUS_TENANT)
        return list(dict.fromkeys(out))


def _tenant(tc: TenantConfig, label: str, trusted: dict[str, list[str] | None]) -> Tenant:
    """The :class:`Tenant` of one configured tenant (namespace, slots, trust)."""
    if tc.namespace is None:
        salt = tenant_salt(tc.name)
        return Tenant(tc.name, tc.role, label, salt, tc.name, (salt,), None, tc.sees_all_stats)
    ns = tc.namespace
    names = trusted[ns]
    top = tenant_salt(ns)
    if names is None:  # every writer of the namespace is trusted: one slot
        return Tenant(tc.name, tc.role, label, top, ns, (top,), None, tc.sees_all_stats)
    low = untrusted_salt(ns)
    is_trusted = tc.name in names
    reads = (top,) if tc.reads == "trusted" else (top, low)
    accepted = frozenset(names) if tc.reads == "trusted" else None
    salt = top if is_trusted else low
    return Tenant(tc.name, tc.role, label, salt, ns, reads, accepted, tc.sees_all_stats)
