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
    """gRPC channel and server options of both ends: message size limits as given, plus framing room.

    HTTP/2 flow control is left to gRPC's bandwidth-delay probing: turning
    it off pins each stream's window at 64 KiB, which caps a stream at
    64 KiB per round trip on a real network (a loopback benchmark would not
    show it).
    """
    limit = max_message_size + FRAME_OVERHEAD
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
    ]
