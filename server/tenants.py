"""Tenants: who a caller is (bearer token → tenant) and the key namespace of each.

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
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvtier.server.config import (
    ANONYMOUS_TENANT,
    OTHER_TENANTS_LABEL,
    ROLE_RANK,
    Role,
    ServerConfig,
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

    def may(self, role: Role) -> bool:
        """Whether this tenant's role includes ``role``."""
        return ROLE_RANK[self.role] >= ROLE_RANK[role]

    def scope(self, keys: Sequence[bytes]) -> list[bytes]:
        """The server-side keys of this tenant's ``keys`` (each 16 bytes)."""
        return [scope_key(self.salt, k) for k in keys]


def scope_key(salt: bytes, key: bytes) -> bytes:
    """The server-side key of a tenant's ``key`` (16 bytes)."""
    return hashlib.sha256(salt + key).digest()[:16]


def tenant_salt(name: str) -> bytes:
    """The 16-byte key salt of a tenant name."""
    return xxhash.xxh3_128_digest(_SALT_DOMAIN + name.encode())


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
        for i, tc in enumerate(config.tenants):
            label = tc.name if i < config.metrics_max_tenants else OTHER_TENANTS_LABEL
            tenant = Tenant(tc.name, tc.role, label, tenant_salt(tc.name))
            self.tenants.append(tenant)
            for digest in tc.token_sha256:
                self._by_digest[digest] = tenant
        self.anonymous = Tenant(
            ANONYMOUS_TENANT, "admin", ANONYMOUS_TENANT, tenant_salt(ANONYMOUS_TENANT)
        )

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
