"""Content addressing: a chunk of tokens is named by a chained hash.

``key_0 = H(namespace)`` and ``key_i = H(key_{i-1} ‖ int32-LE token ids of
chunk i)``. A key therefore names a whole prefix, not just one chunk:
changing a token in chunk ``i`` changes keys ``i, i+1, ...`` and leaves keys
before ``i`` alone. Keys are 16 raw bytes, identical across processes,
machines, Python versions and ``PYTHONHASHSEED`` (Python's ``hash()`` is never
used).

``H`` is chosen per namespace (:class:`KeyHash`):

* ``sha256`` (default): SHA-256 truncated to 16 bytes. Whoever chooses the
  tokens (any user of a shared engine) cannot make two prefixes share a key
  short of a generic attack: ~2**128 work to hit a given key (second
  preimage), ~2**64 for some pair (birthday bound of 128 bits).
* ``xxh3``: xxh3_128, ~10x faster on short inputs but not collision
  resistant against a chosen input: for a cache whose prompts all come from
  one trusted party.

The namespace is a canonical encoding of everything that makes KV differ for
the same tokens: the model and its weights, the KV layout and dtype, the chunk
size, an optional tenant salt and the key hash itself. Two namespaces that
differ in any field never produce the same keys (up to the collision bound),
so keys made with the two hashes never mix.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, NewType, Protocol

import numpy as np
import xxhash

from kvtier.errors import ConfigError

ChunkKey = NewType("ChunkKey", bytes)
"""A 16-byte content address of one chunk (and, through the chain, its prefix)."""

KEY_BYTES = 16
_NAMESPACE_TAG = b"kvtier.namespace.v2"
_INT32_MAX = 2**31 - 1


class KeyHash(enum.StrEnum):
    """The hash that chains keys (see the module docstring)."""

    SHA256 = "sha256"
    XXH3 = "xxh3"

    @classmethod
    def parse(cls, name: str) -> KeyHash:
        """The hash called ``name``.

        Raises:
            ConfigError: for any other name.
        """
        try:
            return cls(name)
        except ValueError:
            raise ConfigError(
                f"unknown key hash {name!r}; expected one of {[h.value for h in cls]}"
            ) from None


class _Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...
    def copy(self) -> _Hasher: ...
    def digest(self) -> bytes: ...


def _new_hasher(kind: KeyHash, seed: bytes) -> _Hasher:
    """A running hash of ``kind`` that has consumed ``seed``."""
    if kind is KeyHash.SHA256:
        return hashlib.sha256(seed)
    return xxhash.xxh3_128(seed)


def _key_of(h: _Hasher) -> ChunkKey:
    """The 16-byte key of a running hash (SHA-256 is truncated to its first 16 bytes)."""
    return ChunkKey(h.digest()[:KEY_BYTES])


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
        key_hash: The chain hash (``"sha256"`` or ``"xxh3"``, see :class:`KeyHash`).
    """

    model_id: str
    weights_fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    chunk_size: int = 256
    tenant_salt: bytes = b""
    key_hash: KeyHash = KeyHash.SHA256

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
        object.__setattr__(self, "key_hash", KeyHash.parse(self.key_hash))

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
            self.key_hash.value.encode(),
        ]
        return b"".join(struct.pack("<I", len(p)) + p for p in parts)

    def root_key(self) -> ChunkKey:
        """``key_0``: the hash of the namespace, the seed of every chain."""
        return _key_of(_new_hasher(self.key_hash, self.encode()))

    def chain(self, prev: bytes) -> _Hasher:
        """A running hash seeded with ``prev``: feed it a chunk's tokens for the next key."""
        return _new_hasher(self.key_hash, prev)

    def with_tenant(self, salt: bytes | str) -> CacheNamespace:
        """The same namespace isolated for one tenant."""
        return replace(self, tenant_salt=salt.encode() if isinstance(salt, str) else salt)

    def to_json(self) -> dict[str, Any]:
        """The namespace as JSON (``tenant_salt`` in hex): how an engine announces it."""
        out = {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in asdict(self).items()}
        out["tenant_salt"] = self.tenant_salt.hex()
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CacheNamespace:
        """The inverse of ``to_json``.

        Raises:
            ValueError, TypeError, KeyError, ConfigError: for a malformed object.
        """
        fields = dict(data)
        fields["tenant_salt"] = bytes.fromhex(str(fields.get("tenant_salt", "")))
        return cls(**fields)


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
        h = namespace.chain(prev)
        h.update(data[start:end])
        prev = _key_of(h)
        keys.append(prev)
        start = end
    return keys


class PrefixKeys:
    """Keys of every page-aligned prefix of a growing token sequence, computed incrementally.

    A *page* is ``P`` = ``page_tokens`` tokens: the granularity at which a
    stored prefix is found (the engine's KV block, 16 tokens, by default;
    "block" in kvtier's core means a stored object's bytes, ``kvtier.block``).
    A stored object covers tokens ``[c*C, c*C + j*P)``: chunk ``c`` (``C`` =
    ``namespace.chunk_size`` tokens) or a leading part of it, ``j`` pages.
    Its key is the chunk chain extended over those tokens::

        key(c, j) = H(K_{c-1} ‖ int32-LE tokens[c*C : c*C + j*P])     K_{-1} = root key
        K_c       = key(c, C // P)                                    (the full chunk)

    so full-chunk keys are exactly ``chunk_keys``'s, and a part of a chunk has
    a key of its own that names the whole prefix it ends. Any prefix whose
    length is a multiple of ``P`` has exactly one key: a lookup can ask for
    all of them in one batched call and find the longest stored prefix at
    page granularity. Keys do not depend on ``P``: two engines with other
    block sizes agree on the boundaries they share.

    Args:
        namespace: Where these tokens' KV lives.
        page_tokens: Key granularity; must divide ``namespace.chunk_size``.
    """

    def __init__(self, namespace: CacheNamespace, page_tokens: int = 16) -> None:
        if page_tokens <= 0 or namespace.chunk_size % page_tokens:
            raise ConfigError(
                f"page_tokens {page_tokens} must divide chunk_size {namespace.chunk_size}"
            )
        self.namespace = namespace
        self.page_tokens = page_tokens
        self.pages_per_chunk = namespace.chunk_size // page_tokens
        self._data = bytearray()
        self._keys: list[ChunkKey] = []  # key of the prefix ending at page b+1, b = 0, 1, ...
        self._root = namespace.root_key()
        self._chain = self._root  # K of the last full chunk hashed so far
        self._running: _Hasher | None = None  # H(K_{c-1} ‖ chunk c's pages hashed so far)

    @property
    def num_tokens(self) -> int:
        """Tokens seen so far."""
        return len(self._data) // 4

    def extend(self, token_ids: Sequence[int] | np.ndarray) -> None:
        """Appends tokens (the sequence only grows: a prompt, then generated tokens)."""
        self._data += _token_bytes(token_ids)

    def _hash_to(self, num_pages: int) -> None:
        bt, per = self.page_tokens * 4, self.pages_per_chunk
        while len(self._keys) < num_pages:
            b = len(self._keys)
            if b % per == 0 or self._running is None:
                self._running = self.namespace.chain(self._chain)
            # NOTE: one running hash per chunk, copied at each page boundary:
            # key(c, j) is still the plain function H(K_{c-1} ‖ tokens of
            # chunk c up to page j) however the sequence was grown (a hash
            # fed in parts equals the hash of the whole), and every token is
            # hashed once instead of once per later page of its chunk.
            self._running.update(self._data[b * bt : (b + 1) * bt])
            key = _key_of(self._running.copy())
            self._keys.append(key)
            if (b + 1) % per == 0:
                self._chain = key

    def key(self, num_tokens: int) -> ChunkKey:
        """The key of the prefix of ``num_tokens`` tokens (``1 <= num_tokens <= self.num_tokens``).

        Raises:
            ValueError: for a length outside the sequence.
        """
        if num_tokens <= 0 or num_tokens > self.num_tokens:
            raise ValueError(f"no prefix of {num_tokens} tokens in {self.num_tokens} tokens")
        b, rest = divmod(num_tokens, self.page_tokens)
        if rest == 0:
            self._hash_to(b)
            return self._keys[b - 1]
        # off a page boundary (a prompt's exact end): hashed on its own, not cached
        self._hash_to(b)
        c0 = (b // self.pages_per_chunk) * self.pages_per_chunk
        chain = self._keys[c0 - 1] if c0 else self._root
        bt = self.page_tokens * 4
        h = self.namespace.chain(chain)
        h.update(self._data[c0 * bt : num_tokens * 4])
        return _key_of(h)

    def boundaries(self, num_tokens: int, step: int | None = None) -> list[int]:
        """Boundaries ``S, 2S, ...`` up to ``num_tokens`` (capped at the sequence); ``S`` is
        ``step``, by default ``page_tokens`` (other steps are correct, and as fast when a
        multiple of it)."""
        s = step or self.page_tokens
        n = min(num_tokens, self.num_tokens) // s
        return [(b + 1) * s for b in range(n)]

    def lookup_ends(self, num_tokens: int, step: int | None = None) -> list[int]:
        """Where a stored prefix of the first ``num_tokens`` tokens can end: every boundary
        (``boundaries``), and ``num_tokens`` itself (a prompt's exact end)."""
        n = min(num_tokens, self.num_tokens)
        ends = self.boundaries(n, step)
        return [*ends, n] if n % (step or self.page_tokens) else ends

    def keys_at(self, ends: Sequence[int]) -> list[ChunkKey]:
        """The keys of the prefixes ending at ``ends``."""
        return [self.key(e) for e in ends]
