"""Configuration of the remote tier (:class:`RemoteTierConfig`), a client of ``kvtier serve``.

In YAML, one item of ``tiers:``::

    - type: remote
      name: cache-server
      address: kvcache.internal:50051
      token_env: KVTIER_SERVER_TOKEN     # or token: "..." (kept out of `config show`)
      tls: true
      ca_file: /etc/kvtier/ca.pem        # default: the system's roots
      timeout_s: 1.0                     # lookup, exists, delete, stats
      transfer_timeout_s: 10.0           # one get or put stream
      retries: 2
      breaker_failures: 5
      breaker_reset_s: 5.0
      data_plane: true                   # Get/Put over the server's data port when it has one

Imports neither grpc nor the tier, so the top-level configuration can embed it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from kvtier.errors import ConfigError


class RemoteTierConfig(BaseModel):
    """A kvtier cache server used as a tier."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["remote"] = "remote"
    name: str = Field("remote", min_length=1, description="metrics label; unique in a store")
    address: str = Field(
        "127.0.0.1:50051", min_length=3, description="host:port of the server's gRPC port"
    )
    token: SecretStr | None = Field(None, description="bearer token (prefer token_env)")
    token_env: str | None = Field(None, description="environment variable holding the token")
    tls: bool = Field(False, description="connect with TLS (implied by ca_file)")
    ca_file: Path | None = Field(None, description="PEM roots to trust; default: the system's")
    server_name: str | None = Field(
        None, description="TLS name to check instead of the address's host (tests, IP addresses)"
    )
    timeout_s: float = Field(1.0, gt=0, description="deadline of lookup, exists, delete, stats")
    transfer_timeout_s: float = Field(10.0, gt=0, description="deadline of one get or put stream")
    retries: int = Field(2, ge=0, le=10, description="retries of transient failures per call")
    retry_backoff_s: float = Field(0.005, ge=0, description="wait before the first retry; doubles")
    retry_backoff_cap_s: float = Field(0.1, ge=0, description="longest wait between retries")
    breaker_failures: int = Field(
        5, ge=1, description="consecutive failed calls that open the circuit breaker"
    )
    breaker_reset_s: float = Field(
        5.0, gt=0, description="how long an open breaker fails fast before a probe"
    )
    put_batch_bytes: int = Field(
        64 * 1024 * 1024, ge=1, description="block bytes per put stream (at least one block)"
    )
    skip_existing: bool = Field(
        True, description="ask which keys the server has before sending blocks, send only the rest"
    )
    usage_refresh_s: float = Field(
        5.0, ge=0, description="how long usage() reuses the server's last answer"
    )
    data_plane: bool = Field(
        True,
        description="move block bytes over the server's bulk data plane when it offers one "
        "(gRPC Get/Put otherwise, and whenever it cannot be reached)",
    )
    data_address: str | None = Field(
        None,
        description="host:port of the data plane when it is not the address's host and the "
        "port the server advertises (port mapping, proxies)",
    )
    data_connections: int = Field(8, ge=0, description="idle data-plane connections kept for reuse")

    @model_validator(mode="after")
    def _check(self) -> RemoteTierConfig:
        if self.token is not None and self.token_env is not None:
            raise ValueError("set token or token_env, not both")
        for field, value in (("address", self.address), ("data_address", self.data_address)):
            if value is None:
                continue
            host, sep, port = value.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{field} {value!r} must be host:port")
        return self

    @property
    def uses_tls(self) -> bool:
        return self.tls or self.ca_file is not None

    def resolve_token(self, env: Mapping[str, str] | None = None) -> str | None:
        """The bearer token, from ``token`` or the ``token_env`` variable.

        Raises:
            ConfigError: ``token_env`` names a variable that is unset or empty.
        """
        if self.token is not None:
            return self.token.get_secret_value()
        if self.token_env is None:
            return None
        env = os.environ if env is None else env
        value = env.get(self.token_env, "").strip()
        if not value:
            raise ConfigError(
                f"tiers[{self.name}].token_env: environment variable {self.token_env} is not set"
            )
        return value
