"""A content fingerprint of a model's weights: every byte, hashed once per file version.

The fingerprint names a model's KV namespace (``kvtier.keys.CacheNamespace``):
two engines share cached KV only if their fingerprints are equal, so it must
change whenever any weight does. It is SHA-256 over, for each stored tensor
in name order, its name, storage dtype, shape, size and the SHA-256 of *all*
its stored bytes::

    fingerprint = SHA-256(SCHEME ‖ for each tensor, sorted by name:
                          len-prefixed name ‖ len-prefixed dtype ‖ shape (int64 LE)
                          ‖ nbytes (int64 LE) ‖ SHA-256(stored bytes))

It depends on tensors, not files: the same tensors split into other shards
give the same fingerprint. Reading every byte of a multi-GB model costs
seconds (SHA-256 ran at ~0.5 GB/s per core on this project's hosts:
SmolLM2-135M's 96.6 MB in 0.19 s, ``bench/keys.py``), so the result is cached by
the identity of the files it came from — resolved path, size, mtime, ctime
and inode of each — in ``~/.cache/kvtier/fingerprints.json`` (under
``$HOME``): the first load of a file version pays, the next ones read a
small JSON file. Any change to a file (a rewrite, a copy over it, even one
that restores the mtime) changes its identity and the weights are hashed
again.

NOTE: why SHA-256 and not the xxh3 that hashes ~50x faster: the fingerprint
is an identity that other engines trust to share KV; a collision between a
fine-tune and its base, however unlikely by accident, should not be within
anyone's reach on purpose either (docs/security.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

SCHEME = b"kvtier.weights.sha256.v2"
"""Tags the fingerprint's definition; part of both the digest and the cache identity."""

RawTensor = tuple[str, str, tuple[int, ...], np.ndarray]
"""``(name, storage dtype, logical shape, stored bytes as a flat uint8 array)``."""

_MAX_CACHE_ENTRIES = 256


def _len_prefixed(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


class WeightsHasher:
    """Hashes tensors as they come (any order); :meth:`hexdigest` combines them by name.

    Raises (``add``):
        ValueError: a tensor name seen twice (the fingerprint would be ambiguous).
    """

    def __init__(self) -> None:
        self._tensors: dict[str, bytes] = {}
        self.nbytes = 0

    def add(self, name: str, dtype: str, shape: Sequence[int], data: np.ndarray) -> None:
        """Digest one tensor from its stored bytes (a flat, contiguous ``uint8`` array)."""
        if name in self._tensors:
            raise ValueError(f"tensor {name!r} appears twice")
        flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        content = hashlib.sha256(flat.data).digest()  # releases the GIL for large buffers
        record = b"".join(
            (
                _len_prefixed(name.encode("utf-8")),
                _len_prefixed(dtype.encode("ascii")),
                _len_prefixed(np.asarray(shape, dtype="<i8").tobytes()),
                struct.pack("<q", flat.size),
                content,
            )
        )
        self._tensors[name] = record
        self.nbytes += int(flat.size)

    def hexdigest(self) -> str:
        """The fingerprint of every tensor added (64 hex digits)."""
        h = hashlib.sha256(SCHEME)
        for name in sorted(self._tensors):
            h.update(self._tensors[name])
        return h.hexdigest()


@dataclass(frozen=True)
class Fingerprint:
    """A weights fingerprint and what it cost.

    Attributes:
        digest: The fingerprint (64 hex digits).
        nbytes: Bytes of tensor data hashed.
        hash_seconds: How long hashing them took (when they were hashed).
        cached: True when it came from the cache (this call hashed nothing).
    """

    digest: str
    nbytes: int
    hash_seconds: float
    cached: bool = False


def default_cache_path() -> Path:
    """``~/.cache/kvtier/fingerprints.json`` (``~`` is ``$HOME``)."""
    return Path("~/.cache/kvtier/fingerprints.json").expanduser()


def file_identity(files: Sequence[Path]) -> str:
    """What must not change for a cached fingerprint of ``files`` to hold.

    Raises:
        OSError: a file cannot be stat'ed.
    """
    parts = []
    for f in sorted(Path(p).resolve() for p in files):
        st = f.stat()
        parts.append([str(f), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
    return json.dumps([SCHEME.decode(), parts], separators=(",", ":"))


class FingerprintCache:
    """Fingerprints by file identity, in one small JSON file.

    Reads and writes are best effort: a missing, unreadable or malformed file
    is an empty cache, a failed write is logged. Writes replace the file
    atomically (several processes may load models at once: the last writer
    wins, nothing is torn). At most ``max_entries`` entries are kept, the
    oldest dropped first.

    Args:
        path: The JSON file.
        max_entries: Bound on the entries kept.
    """

    def __init__(self, path: Path | None = None, max_entries: int = _MAX_CACHE_ENTRIES) -> None:
        self.path = path if path is not None else default_cache_path()
        self.max_entries = max_entries

    def _load(self) -> dict[str, dict[str, object]]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("fingerprint cache %s unreadable (%s); starting it afresh", self.path, e)
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, identity: str) -> Fingerprint | None:
        """The fingerprint stored for ``identity``, or ``None``."""
        entry = self._load().get(identity)
        if not isinstance(entry, dict):
            return None
        try:
            digest, nbytes, seconds = entry["digest"], entry["nbytes"], entry["hash_seconds"]
        except KeyError:
            return None
        if not (isinstance(digest, str) and len(digest) == 64):
            return None
        if not isinstance(nbytes, int) or not isinstance(seconds, int | float):
            return None
        return Fingerprint(digest, nbytes, float(seconds), cached=True)

    def put(self, identity: str, fingerprint: Fingerprint) -> None:
        """Remember ``fingerprint`` for ``identity``."""
        entries = self._load()
        entries.pop(identity, None)
        record = {k: v for k, v in asdict(fingerprint).items() if k != "cached"}
        entries[identity] = {**record, "stored_at": time.time()}
        while len(entries) > self.max_entries:
            entries.pop(next(iter(entries)))  # dicts keep insertion order: the oldest first
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".fingerprints-")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(entries, f)
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as e:
            log.warning("cannot write fingerprint cache %s: %s", self.path, e)


class FingerprintJob:
    """One model's fingerprint: answered by the cache, or hashed from tensors fed to it.

    Lets a loader hash tensors while it reads them for the model (one read of
    the files) — or skip hashing when the cache already knows the files::

        job = FingerprintJob(files)
        for name, dtype, shape, data in read_tensors():
            if job.needed:
                job.add(name, dtype, shape, data)
            ...
        fingerprint = job.finish()

    Args:
        files: Every file the tensors are read from (their identity keys the cache).
        cache: Where fingerprints are remembered (``~/.cache/kvtier/fingerprints.json``
            by default).
        label: What to call the model in the log line (the first file by default).
    """

    def __init__(
        self,
        files: Sequence[Path],
        *,
        cache: FingerprintCache | None = None,
        label: str | None = None,
    ) -> None:
        self._cache = cache if cache is not None else FingerprintCache()
        self._label = label or str(files[0])
        # NOTE: the identity is taken before reading: a file rewritten while it is
        # hashed gets a new identity, so the mixed digest is never served for it.
        try:
            self._identity: str | None = file_identity(files)
        except OSError as e:
            log.warning("cannot stat %s (%s): hashing without the cache", self._label, e)
            self._identity = None
        self.result = self._cache.get(self._identity) if self._identity is not None else None
        self._hasher = WeightsHasher()
        self._seconds = 0.0

    @property
    def needed(self) -> bool:
        """Whether tensors must be fed (the cache did not know the files)."""
        return self.result is None

    def add(self, name: str, dtype: str, shape: Sequence[int], data: np.ndarray) -> None:
        """Hash one stored tensor (see :meth:`WeightsHasher.add`)."""
        start = time.perf_counter()
        self._hasher.add(name, dtype, shape, data)
        self._seconds += time.perf_counter() - start

    def finish(self) -> Fingerprint:
        """The fingerprint: the cached one, or that of the tensors fed (then cached and logged)."""
        if self.result is not None:
            log.debug(
                "weights fingerprint of %s from the cache (hashing took %.2f s)",
                self._label,
                self.result.hash_seconds,
            )
            return self.result
        nbytes, seconds = self._hasher.nbytes, self._seconds
        self.result = Fingerprint(self._hasher.hexdigest(), nbytes, seconds)
        log.info(
            "weights fingerprint of %s: %.1f MB hashed in %.2f s (SHA-256, %.2f GB/s), "
            "cached by file identity",
            self._label,
            nbytes / 1e6,
            seconds,
            nbytes / 1e9 / max(seconds, 1e-9),
        )
        if self._identity is not None:
            self._cache.put(self._identity, self.result)
        return self.result


def weights_fingerprint(
    files: Sequence[Path],
    tensors: Callable[[], Iterable[RawTensor]],
    *,
    cache: FingerprintCache | None = None,
    label: str | None = None,
) -> Fingerprint:
    """The fingerprint of the weights stored in ``files``, from the cache or by hashing.

    Args:
        files: Every file the tensors are read from.
        tensors: Yields every stored tensor; called only when the cache has no answer.
        cache: As for :class:`FingerprintJob`.
        label: As for :class:`FingerprintJob`.
    """
    job = FingerprintJob(files, cache=cache, label=label)
    if job.needed:
        for name, dtype, shape, data in tensors():
            job.add(name, dtype, shape, data)
    return job.finish()
