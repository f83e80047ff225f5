"""The stores ``bench/tier_load.py`` drives, behind one small interface (:class:`LoadClient`).

* :class:`TierClient` — a kvtier :class:`~kvtier.tiers.base.Tier` (the
  Aerospike tier, the remote tier of ``kvtier serve``, Redis' benchmark tier).
* :class:`RawAerospike` — the official ``aerospike`` client used directly,
  doing the least a user must do to keep an object larger than a record:
  the object cut into segments of the tier's segment size, written in one
  ``batch_write`` and read back in one ``batch_read`` of keys it already
  knows, joined. No manifest, no checksum, no dedup check: the baseline the
  tier is held to.
* :func:`object_block` — the KV chunk of a model, encoded as kvtier stores it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aerospike
import torch
import xxhash
from aerospike_helpers.batch.records import BatchRecords, Remove, Write
from aerospike_helpers.operations import operations as as_ops

from kvtier.block import HEADER_SIZE, activation_like_kv, encode_block, verify_block
from kvtier.tiers.aerospike_config import AerospikeTierConfig
from kvtier.tiers.aerospike_namespace import client_config, read_policy
from kvtier.tiers.base import Tier


@dataclass(frozen=True)
class ModelChunk:
    """The KV of one 256-token chunk of a model: ``[layers, 2, tokens, kv_heads, head_dim]``."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    tokens: int = 256

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.tokens, self.kv_heads, self.head_dim)


CHUNKS = {
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, fp32 on CPU: 11.25 MiB per 256 tokens
    "smollm2": ModelChunk("smollm2", 30, 3, 64, torch.float32),
    # Llama-3-8B shape: 32 layers, 8 KV heads of 128, bf16: 32 MiB per 256 tokens
    "llama3-8b": ModelChunk("llama3-8b", 32, 8, 128, torch.bfloat16),
}


def object_block(chunk: ModelChunk, seed: int = 0) -> bytes:
    """One encoded block (kvtier's header + raw payload) of ``chunk``."""
    kv = activation_like_kv(chunk.shape, chunk.dtype, seed=seed)
    return encode_block(kv, key=bytes(16))


# Where the block format keeps the key a block is encoded for, and its checksum (xxh64 of
# the header with the checksum zeroed, then the body): kvtier/block.py.
_CHECKSUM_AT, _KEY_AT = 44, 52


def bound_to(block: bytes, key: bytes) -> bytes:
    """``block`` encoded for ``key`` (a new header, the same body), as a writer would have it.

    kvtier's cache server accepts a block only under the key it was encoded for.
    """
    header = bytearray(block[:HEADER_SIZE])
    header[_KEY_AT : _KEY_AT + len(key)] = key
    header[_CHECKSUM_AT : _CHECKSUM_AT + 8] = bytes(8)
    h = xxhash.xxh64(header)
    h.update(memoryview(block)[HEADER_SIZE:])
    header[_CHECKSUM_AT : _CHECKSUM_AT + 8] = h.intdigest().to_bytes(8, "little")
    # NOTE: one copy of the body (a slice and a concatenation were two, ~10 ms for
    # 11 MiB): CPU the clients spend between timed calls is CPU the stores lose.
    out = b"".join((header, memoryview(block)[HEADER_SIZE:]))
    verify_block(out, key=key)
    return out


def same_object(got: bytes | None, block: bytes, key: bytes) -> bool:
    """Whether ``got`` is ``block`` bound to ``key``: byte for byte, without copies.

    NOTE: ``bytes.startswith`` at an offset is one ``memcmp`` (~1 ms for 11 MiB);
    comparing two memoryviews goes item by item (~22 ms), CPU every client spent
    between its timed calls, taken from the stores it measured.
    """
    if got is None or len(got) != len(block):
        return False
    return got.startswith(key, _KEY_AT) and got.startswith(
        memoryview(block)[HEADER_SIZE:], HEADER_SIZE
    )


class LoadClient(Protocol):
    """What one benchmark client does with a store; thread-safe unless ``per_thread``."""

    def put(self, key: bytes, block: bytes) -> bool: ...

    def get(self, key: bytes) -> bytes | None: ...

    def delete(self, key: bytes) -> None: ...

    def close(self) -> None: ...


class TierClient:
    """A kvtier tier as a :class:`LoadClient` (one key per call, as an engine's chunk).

    ``client_s`` and ``round_trips``: for a tier with ``_round_trip`` (the Aerospike
    tier), the seconds spent inside its round trips (client calls, their retries and
    backoffs) and their count, summed over calls: a call's time outside them is the
    tier's own work (checksums, splitting, joining). Zero for other tiers.
    """

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self.client_s = 0.0
        self.round_trips = 0
        real = getattr(tier, "_round_trip", None)
        if real is not None:

            def timed(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return real(*args, **kwargs)
                finally:
                    self.client_s += time.perf_counter() - t0
                    self.round_trips += 1

            tier._round_trip = timed  # type: ignore[attr-defined]

    def put(self, key: bytes, block: bytes) -> bool:
        return self.tier.put([(key, block)])[0]

    def get(self, key: bytes) -> bytes | None:
        return self.tier.get([key])[0]

    def delete(self, key: bytes) -> None:
        self.tier.delete([key])

    def close(self) -> None:
        self.tier.close()


class RawAerospike:
    """The official client with no kvtier code in the way (see the module docstring).

    Args:
        config: The tier configuration whose hosts, namespace, set, timeouts and
            pool it uses (the same client policies as the tier).
        segment_size: Bytes per segment record (the tier's learned segment size).
        object_bytes: Size of every object it stores (it reads back that many segments).
    """

    def __init__(self, config: AerospikeTierConfig, segment_size: int, object_bytes: int) -> None:
        self.config = config
        self.segment_size = segment_size
        self.n_segments = -(-object_bytes // segment_size)
        self.client: Any = aerospike.client(client_config(config))
        self._read = read_policy(config)
        self._write = {
            "total_timeout": config.write_timeout_ms,
            "socket_timeout": config.socket_timeout_ms,
            "max_retries": 0,
        }
        self._row = {"ttl": config.ttl_s, "key": aerospike.POLICY_KEY_DIGEST}

    def _keys(self, key: bytes) -> list[tuple[str, str, bytearray]]:
        ns, set_name = self.config.namespace, self.config.set_name
        return [
            (ns, set_name, bytearray(key + i.to_bytes(4, "big"))) for i in range(self.n_segments)
        ]

    def put(self, key: bytes, block: bytes) -> bool:
        size = self.segment_size
        rows = [
            Write(k, [as_ops.write("s", block[i * size : (i + 1) * size])], policy=self._row)
            for i, k in enumerate(self._keys(key))
        ]
        res = self.client.batch_write(BatchRecords(rows), policy_batch=self._write)
        return all(r.result == 0 for r in res.batch_records)

    def get(self, key: bytes) -> bytes | None:
        res = self.client.batch_read(self._keys(key), ["s"], policy=self._read)
        parts = []
        for r in res.batch_records:
            if r.result != 0 or not r.record[2]:
                return None
            parts.append(r.record[2]["s"])
        return b"".join(parts)

    def delete(self, key: bytes) -> None:
        self.client.batch_write(
            BatchRecords([Remove(k) for k in self._keys(key)]), policy_batch=self._write
        )

    def close(self) -> None:
        self.client.close()


class PerThread:
    """A :class:`LoadClient` made once per thread (a client that holds one connection)."""

    def __init__(self, make: Callable[[], LoadClient]) -> None:
        self._make = make
        self._local = threading.local()
        self._all: list[LoadClient] = []
        self._lock = threading.Lock()

    def _mine(self) -> LoadClient:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = self._make()
            with self._lock:
                self._all.append(client)
        return client

    def put(self, key: bytes, block: bytes) -> bool:
        return self._mine().put(key, block)

    def get(self, key: bytes) -> bytes | None:
        return self._mine().get(key)

    def delete(self, key: bytes) -> None:
        self._mine().delete(key)

    def close(self) -> None:
        for client in self._all:
            client.close()


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``samples``, nearest rank (the largest sample at 1)."""
    ordered = sorted(samples)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(len(ordered), rank) - 1]
