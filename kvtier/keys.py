"""Content addressing: a chunk of tokens is named by a chained xxh3_128 hash.

``key_0 = xxh3_128(namespace)`` and ``key_i = xxh3_128(key_{i-1} ‖ int32-LE
token ids of chunk i)``. A key therefore names a whole prefix, not just one
chunk: changing a token in chunk ``i`` changes keys ``i, i+1, ...`` and leaves
keys before ``i`` alone. Keys are 16 raw bytes, identical across processes,
machines, Python versions and ``PYTHONHASHSEED`` (Python's ``hash()`` is never
used).

The namespace is a canonical encoding of everything that makes KV differ for
the same tokens: the model and its weights, the KV layout and dtype, the chunk
size, and an optional tenant salt. Two namespaces that differ in any field
never produce the same keys (up to the 128-bit collision bound).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NewType

import numpy as np
import xxhash

from kvtier.errors import ConfigError

ChunkKey = NewType("ChunkKey", bytes)
"""A 16-byte content address of one chunk (and, through the chain, its prefix)."""

KEY_BYTES = 16
_NAMESPACE_TAG = b"kvtier.namespace.v1"
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class CacheNamespace:
    """Everything that makes the KV of a token sequence differ.

    Attributes:
        model_id: A human-readable model name (``"SmolLM2-135M-Instruct"``).
        weights_fingerprint: A hash of the weights; two files with the same
            name but other weights must not share KV.
        num_layers: Transformer layers.
        num_kv_heads: Key/value heads (after GQA).
        head_dim: Size of one head.
        kv_dtype: The dtype the engine computes KV in (``"bfloat16"`` ...).
            The stored encoding (raw/int8/fp8) is not part of the namespace:
            every encoding decodes back to this dtype, so engines that store
            with different encodings still share chunks.
        chunk_size: Tokens per chunk.
        tenant_salt: Isolates tenants; empty for a single-tenant cache.
    """

    model_id: str
    weights_fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    chunk_size: int = 256
    tenant_salt: bytes = b""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"CacheNamespace.{name} must be a positive int, got {value!r}")
        if not self.model_id:
            raise ConfigError("CacheNamespace.model_id must not be empty")
        if not self.kv_dtype:
            raise ConfigError("CacheNamespace.kv_dtype must not be empty")
        if isinstance(self.tenant_salt, str):
            object.__setattr__(self, "tenant_salt", self.tenant_salt.encode())

    def encode(self) -> bytes:
        """The canonical byte encoding: a tag, then length-prefixed fields in fixed order."""
        parts = [
            _NAMESPACE_TAG,
            self.model_id.encode(),
            self.weights_fingerprint.encode(),
            struct.pack(
                "<IIII", self.num_layers, self.num_kv_heads, self.head_dim, self.chunk_size
            ),
            self.kv_dtype.encode(),
            self.tenant_salt,
        ]
        return b"".join(struct.pack("<I", len(p)) + p for p in parts)

    def root_key(self) -> ChunkKey:
        """``key_0``: the hash of the namespace, the seed of every chain."""
        return ChunkKey(xxhash.xxh3_128_digest(self.encode()))

    def with_tenant(self, salt: bytes | str) -> CacheNamespace:
        """The same namespace isolated for one tenant."""
        return replace(self, tenant_salt=salt.encode() if isinstance(salt, str) else salt)


def _token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token_ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > _INT32_MAX:
        raise ValueError("token_ids must lie in [0, 2**31 - 1]")
    return arr.astype("<i4", copy=False).tobytes()


def chunk_keys(
    token_ids: Sequence[int] | np.ndarray,
    namespace: CacheNamespace,
    *,
    include_partial: bool = False,
) -> list[ChunkKey]:
    """Keys of the chunks of ``token_ids``, in order.

    Args:
        token_ids: The token sequence (any int sequence or 1-D integer array).
        namespace: Where these tokens' KV lives.
        include_partial: Also return a key for a trailing chunk shorter than
            ``namespace.chunk_size``. Its key differs from the key the full
            chunk will have once more tokens arrive.

    Returns:
        One 16-byte key per chunk; ``len(token_ids) // chunk_size`` keys, plus
        one if ``include_partial`` and a remainder exists.
    """
    data = _token_bytes(token_ids)
    step = namespace.chunk_size * 4
    n_full, rest = divmod(len(data), step)
    ends = [step * (i + 1) for i in range(n_full)]
    if include_partial and rest:
        ends.append(len(data))
    keys: list[ChunkKey] = []
    prev = namespace.root_key()
    start = 0
    for end in ends:
        h = xxhash.xxh3_128(prev)
        h.update(data[start:end])
        prev = ChunkKey(h.digest())
        keys.append(prev)
        start = end
    return keys
