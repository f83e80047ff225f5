"""A stable content fingerprint of a model's weights."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import xxhash

# NOTE: hashing every byte of a multi-GB model would dominate load time; a
# fixed, evenly spaced sample of windows catches any re-quantization,
# fine-tune or truncation while reading only a few MB.
_FULL_HASH_BYTES = 64 * 1024
_WINDOWS = 64
_WINDOW_BYTES = 256


@dataclass(frozen=True)
class TensorDigest:
    """What the fingerprint keeps of one source tensor.

    Attributes:
        name: Tensor name in the source file.
        dtype: Storage type name in the file (``"Q4_1"``, ``"bfloat16"`` ...).
        shape: Logical shape.
        nbytes: Stored size in bytes.
        sample: Sampled stored bytes (all of them for small tensors).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    sample: bytes

    @classmethod
    def of(cls, name: str, dtype: str, shape: tuple[int, ...], data: np.ndarray) -> TensorDigest:
        """Digests one tensor from its raw stored bytes (flat ``uint8``)."""
        n = int(data.size)
        if n <= _FULL_HASH_BYTES:
            sample = data.tobytes()
        else:
            starts = np.linspace(0, n - _WINDOW_BYTES, _WINDOWS).astype(np.int64)
            sample = b"".join(data[s : s + _WINDOW_BYTES].tobytes() for s in starts)
        return cls(name=name, dtype=dtype, shape=tuple(shape), nbytes=n, sample=sample)


def fingerprint(tensors: Iterable[TensorDigest]) -> str:
    """Hex xxh3-128 digest over names, dtypes, shapes, sizes and sampled bytes.

    The order of ``tensors`` does not matter (they are sorted by name).
    """
    h = xxhash.xxh3_128()
    for t in sorted(tensors, key=lambda t: t.name):
        h.update(t.name.encode("utf-8"))
        h.update(b"\0" + t.dtype.encode("ascii") + b"\0")
        h.update(np.asarray(t.shape, dtype="<i8").tobytes())
        h.update(np.asarray([t.nbytes], dtype="<i8").tobytes())
        h.update(t.sample)
    return h.hexdigest()
