"""Which plane carries the remote tier's Get and Put: the server's data plane or gRPC.

:class:`PlaneSelector` keeps what the server's last ``Health`` said about its
data plane, the :class:`~kvtier.tiers.remote_dataplane.DataPlaneClient` for
that address, and the address that last failed to connect (left alone for
a cool-down: Get/Put use gRPC meanwhile), and counts which plane carried
each attempt (:class:`TransportCounts`).

Decision per attempt::

    data_plane: false in the config ................................ gRPC
    Health not asked yet / not offered / another data protocol ....... gRPC
    the data-plane address failed < breaker_reset_s ago .............. gRPC
    otherwise ........................................................ data plane
        unreachable (DataPlaneUnavailableError) → this attempt over gRPC,
        the address cools down, Health is asked again (a restarted server
        may have another data port, which is then tried at once)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.tiers.remote_config import RemoteTierConfig
from kvtier.tiers.remote_dataplane import DataPlaneClient, client_tls_context


@dataclass
class TransportCounts:
    """Get and Put attempts per plane, fallbacks to gRPC, data-plane connections opened."""

    data_gets: int = 0
    data_puts: int = 0
    grpc_gets: int = 0
    grpc_puts: int = 0
    fallbacks: int = 0
    """Attempts that found the data plane unreachable and went over gRPC instead."""
    connects: int = 0
    """Data-plane connections opened."""


class PlaneSelector:
    """Picks the plane of each Get/Put attempt of one remote tier.

    Args:
        config: The tier's configuration (address, TLS, timeouts, pool size).
        token: The bearer token.
        on_limit_refusal: Given to the data-plane client (the tier asks for
            the server's limits again).
        on_fallback: Called once per attempt that falls back to gRPC (metrics).

    Thread-safe.
    """

    def __init__(
        self,
        config: RemoteTierConfig,
        token: str | None,
        on_limit_refusal: Callable[[], None],
        on_fallback: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self._on_fallback = on_fallback
        self._token = token
        self._on_limit_refusal = on_limit_refusal
        self._lock = threading.Lock()
        self._advertised = 0  # the data port Health advertised (0: none we can speak)
        self._client: DataPlaneClient | None = None
        self._failed: tuple[str, int] | None = None
        self._retry_at = 0.0
        self._counts = TransportCounts()

    def advertised(self, port: int) -> None:
        """What the server's Health said: its data port, 0 when none (or another protocol)."""
        with self._lock:
            self._advertised = port

    def client(self) -> DataPlaneClient | None:
        """The data-plane client for this attempt, or ``None``: use gRPC."""
        if not self.config.data_plane:
            return None
        with self._lock:
            port = self._advertised
            if not port:
                return None
            host = self.config.address.rpartition(":")[0]
            if self.config.data_address is not None:
                host, _, p = self.config.data_address.rpartition(":")
                port = int(p)
            where = (host.strip("[]"), port)
            if where == self._failed and time.monotonic() < self._retry_at:
                return None
            client = self._client
            if client is None or client.address != where:
                if client is not None:
                    client.close()
                client = self._client = self._connect_to(host, port)
            return client

    def unavailable(self, client: DataPlaneClient) -> None:
        """``client``'s address could not be used: gRPC for ``breaker_reset_s``; count it."""
        with self._lock:
            self._counts.fallbacks += 1
            self._failed = client.address
            self._retry_at = time.monotonic() + self.config.breaker_reset_s
            self._advertised = 0  # until Health says again
        if self._on_fallback is not None:
            self._on_fallback()

    def count(self, field: str) -> None:
        """One more of ``field`` (a :class:`TransportCounts` name)."""
        with self._lock:
            setattr(self._counts, field, getattr(self._counts, field) + 1)

    def counts(self) -> TransportCounts:
        with self._lock:
            return TransportCounts(**vars(self._counts))

    def address(self) -> str | None:
        """``host:port`` of the data plane in use (``None``: none yet)."""
        with self._lock:
            return None if self._client is None else "{}:{}".format(*self._client.address)

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()

    def _connect_to(self, host: str, port: int) -> DataPlaneClient:
        c = self.config
        return DataPlaneClient(
            c.name,
            host,
            port,
            self._token,
            on_connect=lambda: self.count("connects"),
            tls=client_tls_context(str(c.ca_file) if c.ca_file else None) if c.uses_tls else None,
            server_hostname=c.server_name,
            connect_timeout_s=c.timeout_s,
            max_idle=c.data_connections,
            on_limit_refusal=self._on_limit_refusal,
        )
