"""Wire-level constants shared by the server and its clients: method paths and channel options.

Part of the protocol leaf (like the stubs): the remote tier imports it without
importing the server.
"""

from __future__ import annotations

from typing import Any

SERVICE_NAME = "kvtier.cache.v1.KvCache"
"""The gRPC service of ``kvtier_cache.proto``."""

FRAME_OVERHEAD = 64 * 1024
"""Room above a message size limit for protobuf and gRPC framing."""

CLIENT_MAX_RECEIVE = 64 * 1024 * 1024
"""What a client accepts in one message; servers send frames of their ``chunk_size`` (≤ this)."""


def method(name: str) -> str:
    """The full path of one method, e.g. ``/kvtier.cache.v1.KvCache/Get``."""
    return f"/{SERVICE_NAME}/{name}"


def channel_options(max_message_size: int) -> list[tuple[str, Any]]:
    """gRPC channel and server options of both ends.

    Message size limits as given (plus framing room). BDP probing is off:
    on loopback and datacenter links its flow-control window updates cost
    more than they win for streams of megabyte frames (``docs/server.md``).
    """
    limit = max_message_size + FRAME_OVERHEAD
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        ("grpc.http2.bdp_probe", 0),
    ]
