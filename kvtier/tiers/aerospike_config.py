"""Configuration of the Aerospike tier (:class:`AerospikeTierConfig`).

In YAML, one item of ``tiers:``::

    - type: aerospike
      hosts: ["aerospike:3000"]
      namespace: kvcache
      set_name: kvblocks
      ttl_s: 86400
      segment_size: 512KiB        # optional; learned from the server if absent

TTL and nsup: a positive ``ttl_s`` (or ``0`` when the namespace has a
non-zero ``default-ttl``) needs the namespace's ``nsup-period`` to be
non-zero — otherwise the server refuses every write with error 22
(FORBIDDEN), unless ``allow-ttl-without-nsup`` is set, in which case
records never actually expire. Expiry is what reclaims orphan segments left
by a writer that died before committing its manifest, and eviction only
removes records that have a TTL, so a cache namespace wants both a TTL and
nsup. ``ttl_s: -1`` (never expire) is accepted but leaks such orphans.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from kvtier.units import parse_bytes

MAX_TTL_S = 10 * 365 * 24 * 3600
"""The server's largest TTL (10 years)."""

MAX_RECORD_SIZE_LIMIT = 8 * 1024 * 1024
"""The largest ``max-record-size`` a server accepts (8 MiB)."""

MAX_REQUEST_BYTES = 128 * 1024 * 1024
"""A request larger than this makes the server drop the connection."""


def _bytes(value: Any) -> Any:
    return (
        parse_bytes(value)
        if isinstance(value, int | str) and not isinstance(value, bool)
        else value
    )


ByteCount = Annotated[int, BeforeValidator(_bytes)]


class AerospikeHost(BaseModel):
    """One seed node."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(min_length=1)
    port: int = Field(3000, ge=1, le=65535)

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _parse_host(value: Any) -> Any:
    """``"host"``, ``"host:port"`` or ``"[v6addr]:port"`` -> :class:`AerospikeHost` fields."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if not text:
        raise ValueError("empty host")
    if text.startswith("["):
        addr, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"bad host {value!r}; expected [ipv6]:port")
        port = rest[1:] if rest else "3000"
    elif text.count(":") == 1:
        addr, port = text.split(":")
    elif ":" in text:
        raise ValueError(f"bad host {value!r}; write IPv6 addresses as [addr]:port")
    else:
        addr, port = text, "3000"
    if not addr:
        raise ValueError(f"bad host {value!r}: no address")
    if not port.isdigit():
        raise ValueError(f"bad port in host {value!r}")
    return {"host": addr, "port": int(port)}


HostSpec = Annotated[AerospikeHost, BeforeValidator(_parse_host)]


class AerospikeTierConfig(BaseModel):
    """The fleet-wide Aerospike tier. Byte sizes accept ``"512KiB"``-style strings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["aerospike"] = "aerospike"
    name: str = Field("aerospike", min_length=1, description="metrics label; unique in a store")
    hosts: list[HostSpec] = Field(
        default_factory=lambda: [AerospikeHost(host="127.0.0.1", port=3000)],
        min_length=1,
        description='seed nodes: "host:port" strings or {host, port} objects',
    )
    namespace: str = Field("kvcache", min_length=1, max_length=31)
    set_name: str = Field("kvblocks", min_length=1, max_length=63)
    cluster_name: str | None = Field(
        None, description="if set, the client checks the cluster's name"
    )
    ttl_s: int = Field(
        86400,
        ge=-1,
        le=MAX_TTL_S,
        description="record TTL: 0 = namespace default-ttl, -1 = never expire (needs nsup-period > 0 otherwise)",
    )
    connect_timeout_ms: int = Field(1000, ge=1, description="cluster connect, tend and info calls")
    socket_timeout_ms: int = Field(
        500, ge=0, description="idle socket timeout per attempt (0: none)"
    )
    total_timeout_ms: int = Field(1000, ge=1, description="whole read, exists and batch-read calls")
    write_timeout_ms: int = Field(2000, ge=1, description="whole write, touch and remove calls")
    max_retries: int = Field(
        2, ge=0, le=10, description="retries of transient errors per round trip"
    )
    replica_retries: int = Field(
        1,
        ge=0,
        le=4,
        description="reads: the client's retries on the next replica (POLICY_REPLICA_SEQUENCE) "
        "within one attempt, after socket_timeout_ms without an answer or at once on a refused "
        "connection; what makes a read survive a dead or paused node (0: off)",
    )
    retry_backoff_ms: float = Field(5.0, ge=0, description="wait before the first retry; doubles")
    retry_backoff_cap_ms: float = Field(100.0, ge=0, description="longest wait between retries")
    max_conns_per_node: int = Field(100, ge=1, description="connection pool size per node")
    segment_size: ByteCount | None = Field(
        None,
        description="bytes per segment record; None: max-record-size minus record_size_margin",
    )
    record_size_margin: ByteCount = Field(
        4096,
        ge=0,
        description="bytes kept free under max-record-size for record overhead (~60 B per record)",
    )
    max_batch_bytes: ByteCount = Field(
        # NOTE: 32 MiB split the write of one 8B-class chunk (32 MiB of KV plus its header)
        # into two requests; half the server's 128 MiB request limit takes it whole.
        MAX_REQUEST_BYTES // 2,
        ge=64 * 1024,
        le=MAX_REQUEST_BYTES // 2,
        description="bound on the payload of one batch write / segment batch read",
    )
    max_batch_keys: int = Field(
        5000, ge=1, le=100_000, description="rows per batch (server batch-max-requests)"
    )
    breaker_threshold: int = Field(
        5, ge=1, description="consecutive failed calls that open the breaker"
    )
    breaker_cooldown_s: float = Field(
        5.0, gt=0, description="seconds the tier is skipped once open"
    )
    recency: Literal["read_touch", "touch", "none"] = Field(
        "read_touch",
        description="how reads refresh TTL: server-side read-touch (7.1+), explicit touch, or not at all",
    )
    read_touch_ttl_percent: int = Field(
        80,
        ge=1,
        le=100,
        description="with recency=read_touch: touch reads within this % of end of life",
    )
    skip_existing: bool = Field(
        False,
        description="before uploading, ask which blocks the namespace already holds complete "
        "(one batch read of the chunk keys' manifest bin, one batch exists of the segments they "
        "name) and send only the others: saves the upload of a held block, costs every put one "
        "round trip first (off: a held block is still found by the create-only write, which "
        "stores nothing, after its bytes travelled)",
    )
    cleanup_grace_s: float = Field(
        60.0,
        ge=0,
        description="a reader removes a manifest whose segments are missing or wrong only if "
        "the server last wrote it longer ago than this (a put sends a manifest with its "
        "segments, so a younger one may be a write in flight); keep it above every writer's "
        "write_timeout_ms (0: at once, for a single writer)",
    )
    usage_refresh_s: float = Field(
        10.0, ge=0, description="usage() asks the server at most this often (0: every call)"
    )

    @field_validator("segment_size")
    @classmethod
    def _check_segment_size(cls, v: int | None) -> int | None:
        if v is not None and not 1024 <= v <= MAX_RECORD_SIZE_LIMIT:
            raise ValueError(f"segment_size must be between 1KiB and 8MiB, got {v}")
        return v

    @model_validator(mode="after")
    def _check(self) -> AerospikeTierConfig:
        if self.retry_backoff_cap_ms < self.retry_backoff_ms:
            raise ValueError(
                f"retry_backoff_cap_ms ({self.retry_backoff_cap_ms}) must be >= retry_backoff_ms ({self.retry_backoff_ms})"
            )
        if self.segment_size is not None and self.segment_size > self.max_batch_bytes:
            raise ValueError("segment_size must not exceed max_batch_bytes")
        if 0 < self.cleanup_grace_s * 1000 < self.write_timeout_ms:
            raise ValueError(
                f"cleanup_grace_s ({self.cleanup_grace_s}) must be 0 or at least write_timeout_ms "
                f"({self.write_timeout_ms} ms): a reader could remove a manifest whose write is "
                "still in flight"
            )
        return self

    def host_list(self) -> list[tuple[str, int]]:
        """Seeds as the client wants them."""
        return [(h.host, h.port) for h in self.hosts]
