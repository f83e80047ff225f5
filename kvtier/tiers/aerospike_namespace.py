"""What the Aerospike tier asks of the cluster and learns from it (pure functions, no I/O).

* :func:`client_config` — the client's configuration: seeds, pool, timeouts;
  the client retries reads on the next replica only (:func:`read_policy`),
  the tier retries everything else.
* :func:`parse_info` — ``info_all`` replies into one ``{key: value}`` dict per node.
* :func:`record_limits` — the segment size from the nodes' ``namespace/<ns>``
  replies: the smallest ``max-record-size`` (older servers:
  ``write-block-size``) minus the margin, or the configured override.
* :func:`check_ttl` — whether ``ttl_s`` can work with the namespace's nsup
  settings (with ``nsup-period 0`` the server refuses TTL writes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aerospike

from kvtier.errors import ConfigError
from kvtier.tiers.aerospike_config import AerospikeTierConfig

RECORD_OVERHEAD = 64
"""Bytes a record needs besides its payload, rounded up (52 for one short bin
and a 4-letter set, 4 more with a TTL, plus the set name's length)."""

DEFAULT_MAX_RECORD_SIZE = 1024 * 1024
"""Assumed when a server reports no cap (the 7.1+ default)."""


@dataclass(frozen=True)
class RecordLimits:
    """What the tier learned about record sizes at connect.

    Attributes:
        max_record_size: The smallest ``max-record-size`` of the cluster's nodes.
        segment_size: The largest block stored as one record, and the payload
            of each segment record of larger blocks.
        source: Where the segment size came from: ``max-record-size``,
            ``write-block-size``, ``assumed`` or ``override``.
    """

    max_record_size: int
    segment_size: int
    source: str


def read_policy(config: AerospikeTierConfig) -> dict[str, Any]:
    """The policy of reads, exists and batch reads.

    The client retries a read on the next replica (``replica_retries`` times,
    ``POLICY_REPLICA_SEQUENCE``): after ``socket_timeout_ms`` without an
    answer from a paused node, or at once on a dead node's refused
    connection, within the attempt's ``total_timeout_ms``. The tier's own
    :class:`~kvtier.retry.Retry` would send the whole call to the same
    master again: until the cluster has dropped a dead node (about 2 s)
    the client's partition map still names it.
    """
    return {
        "total_timeout": config.total_timeout_ms,
        "socket_timeout": config.socket_timeout_ms,
        "max_retries": config.replica_retries,
        "replica": aerospike.POLICY_REPLICA_SEQUENCE,
        "sleep_between_retries": 0,
    }


def client_config(config: AerospikeTierConfig) -> dict[str, Any]:
    """The ``aerospike.client()`` configuration for a tier."""
    read = read_policy(config)
    write = {
        "total_timeout": config.write_timeout_ms,
        "socket_timeout": config.socket_timeout_ms,
        "max_retries": 0,
    }
    cfg: dict[str, Any] = {
        "hosts": config.host_list(),
        "connect_timeout": config.connect_timeout_ms,
        "max_conns_per_node": config.max_conns_per_node,
        "policies": {
            "read": read,
            "batch": read,
            "write": write,
            "operate": write,
            "remove": write,
            "batch_parent_write": write,
            "info": {"timeout": config.connect_timeout_ms},
        },
    }
    if config.cluster_name:
        cfg["cluster_name"] = config.cluster_name
    return cfg


def parse_info(
    command: str, replies: dict[str, tuple[Any, str | None]], sep: str
) -> list[dict[str, str]]:
    """One dict per node from ``client.info_all(command)``; ``sep`` separates the pairs.

    Raises:
        ValueError: a node answered with an error.
    """
    out = []
    for node, (err, text) in replies.items():
        if err is not None:
            raise ValueError(f"info {command!r} failed on node {node}: {err}")
        text = (text or "").strip()
        if text.startswith(command + "\t"):
            text = text[len(command) + 1 :]
        # NOTE: replies end in ";" whatever separates their pairs (sets/... use ":").
        pairs = (p.split("=", 1) for p in text.strip(sep + ";").split(sep) if "=" in p)
        out.append({k: v for k, v in pairs})
    return out


def _int(info: dict[str, str], key: str) -> int:
    try:
        return int(info.get(key, "0") or 0)
    except ValueError:
        return 0


def record_limits(
    config: AerospikeTierConfig, infos: list[dict[str, str]], where: str
) -> RecordLimits:
    """The record limits from every node's ``namespace/<ns>`` reply.

    Raises:
        ConfigError: the namespace does not exist, or the segment size cannot fit.
    """
    label = f"aerospike tier {config.name!r}"
    if not infos or any(i.get("type") == "unknown" or i.get("ns_type") == "unknown" for i in infos):
        raise ConfigError(f"{label}: namespace {config.namespace!r} does not exist on {where}")
    sizes, source = [], "assumed"
    for info in infos:
        for key, name in (
            ("max-record-size", "max-record-size"),
            ("storage-engine.write-block-size", "write-block-size"),
            ("write-block-size", "write-block-size"),
        ):
            if _int(info, key) > 0:
                sizes.append(_int(info, key))
                source = name
                break
    max_record = min(sizes) if sizes else DEFAULT_MAX_RECORD_SIZE
    if config.segment_size is not None:
        if config.segment_size + RECORD_OVERHEAD + len(config.set_name) > max_record:
            raise ConfigError(
                f"{label}: segment_size {config.segment_size} does not fit the namespace's "
                f"max-record-size {max_record} with record overhead; lower segment_size"
            )
        return RecordLimits(max_record, config.segment_size, "override")
    segment = max_record - max(config.record_size_margin, RECORD_OVERHEAD + len(config.set_name))
    if segment < 1024:
        raise ConfigError(
            f"{label}: record_size_margin {config.record_size_margin} leaves {segment} bytes of the "
            f"namespace's max-record-size {max_record}; lower record_size_margin"
        )
    return RecordLimits(max_record, segment, source)


def check_ttl(config: AerospikeTierConfig, infos: list[dict[str, str]]) -> bool:
    """Whether the tier's records will expire; raises if its TTL cannot work at all.

    Raises:
        ConfigError: ``ttl_s`` needs nsup and a node runs without it.
    """
    expires = True
    for info in infos:
        nsup = _int(info, "nsup-period")
        allow = info.get("allow-ttl-without-nsup", "false") == "true"
        uses_ttl = config.ttl_s > 0 or (config.ttl_s == 0 and _int(info, "default-ttl") > 0)
        if uses_ttl and nsup == 0 and not allow:
            raise ConfigError(
                f"aerospike tier {config.name!r}: ttl_s={config.ttl_s} needs nsup-period > 0 on "
                f"namespace {config.namespace!r} (the server refuses TTL writes while nsup is off); "
                "enable nsup or set ttl_s: -1"
            )
        if not uses_ttl or nsup == 0:
            expires = False
    return expires
