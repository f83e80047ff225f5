"""A stand-in for vLLM's ZMQ KV event publisher (its wire format, 127.0.0.1, free ports).

As ``vllm.distributed.kv_events.ZmqEventPublisher``: a PUB socket sends
``(topic, seq: 8 bytes big-endian, msgpack [ts, events, dp_rank])``; a ROUTER
socket answers a replay request ``(b"", start seq)`` with every buffered
batch from ``start`` on, then ``(b"", b"", -1, b"")``. ``publish(...,
drop=True)`` numbers and buffers a batch without sending it (what a PUB
socket past its high-water mark does), so a subscriber sees a gap.
tests/vllm checks the format against real vLLM.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgpack
import zmq


def block_stored(
    hashes: list[bytes], parent: bytes | None, tokens: list[int], block_size: int, **extra: Any
) -> dict[str, Any]:
    """A ``BlockStored`` event as vLLM encodes it (a map tagged with its type)."""
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
    }
    ev.update(extra)
    return ev


def block_removed(hashes: list[bytes]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


ALL_CLEARED: dict[str, Any] = {"type": "AllBlocksCleared"}


class FakeVllmPublisher:
    """PUB + replay ROUTER on free 127.0.0.1 ports; ``close()`` stops it."""

    def __init__(self, topic: str = "") -> None:
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        port = self._pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._replay = self._ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        rport = self._replay.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self._topic = topic.encode()
        self._seq = 0
        self._buffer: list[tuple[int, bytes]] = []
        self._lock = threading.Lock()  # zmq sockets are not thread-safe
        self.replays = 0
        self._running = True
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def publish(self, events: list[dict[str, Any]], *, drop: bool = False) -> int:
        """Sends one batch (or only numbers and buffers it); returns its sequence number."""
        payload = msgpack.packb([time.time(), events, 0], use_bin_type=True)
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
            if not drop:
                self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
        return seq

    def restart(self) -> None:
        """Numbers start again at 0 with an empty buffer (a restarted engine)."""
        with self._lock:
            self._seq = 0
            self._buffer = []

    def _serve_replay(self) -> None:
        while self._running:
            with self._lock:
                if self._replay.poll(0):
                    client, _, start_raw = self._replay.recv_multipart()
                    start = int.from_bytes(start_raw, "big")
                    self.replays += 1
                    for seq, payload in self._buffer:
                        if seq >= start:
                            self._replay.send_multipart(
                                [client, b"", self._topic, seq.to_bytes(8, "big"), payload]
                            )
                    end = (-1).to_bytes(8, "big", signed=True)
                    self._replay.send_multipart([client, b"", b"", end, b""])
            time.sleep(0.005)

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=5)
        self._pub.close(linger=0)
        self._replay.close(linger=0)
        self._ctx.term()
