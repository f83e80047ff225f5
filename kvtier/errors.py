"""The kvtier exception hierarchy.

A miss is a value (``None``, ``False``, a count); a failure is one of these.
Every class is classified so that callers decide by kind, not by message:

* :class:`TransientError` — retrying may succeed (timeouts, overload,
  dropped connections, an open circuit breaker, a caller's deadline that
  passed before the call could run: :class:`DeadlineExceededError`).
* :class:`CorruptBlockError` — bytes from a tier are not a valid block, or
  a valid block of another key (:class:`KeyMismatchError`). The store turns
  it into a miss, counts it (by ``reason``) and deletes the block.
* :class:`ConfigError` — the configuration is wrong; fix it, retrying won't.
* :class:`AuthError` — the caller is not allowed to do this.

None of these shadow built-ins (``ConnectionError``, ``TimeoutError``).
"""

from __future__ import annotations


class KvtierError(Exception):
    """Base class of every error raised by kvtier."""


class ConfigError(KvtierError):
    """The configuration is invalid or names something that does not exist."""


class TransientError(KvtierError):
    """A failure that may succeed on retry: timeout, overload, lost connection."""


class TierUnavailableError(TransientError):
    """The tier is skipped for now (its circuit breaker is open)."""


class DeadlineExceededError(TransientError):
    """The caller's deadline passed before the I/O it needed could start.

    Raised without an attempt (or between attempts of a multi-round-trip
    call): it says nothing about the tier's health, so it never counts
    against a circuit breaker. An attempt that was cut short by the deadline
    raises its own timeout error instead.
    """


class CapacityError(KvtierError):
    """An item can never fit in the tier (larger than its whole capacity)."""


class AuthError(KvtierError):
    """The caller is not authenticated or not allowed to do this."""


class CorruptBlockError(KvtierError):
    """Bytes read back from a tier do not form a valid block.

    ``reason`` names the kind in metrics (``kvtier_corrupt_block_reasons_total``).
    """

    reason = "corrupt"


class BadMagicError(CorruptBlockError):
    """The block does not start with the kvtier magic bytes."""

    reason = "magic"


class UnsupportedVersionError(CorruptBlockError):
    """The block was written by a format version this reader does not know."""

    reason = "version"


class BadHeaderError(CorruptBlockError):
    """A header field holds an impossible value (unknown enum, zero dimension...)."""

    reason = "header"


class BadLengthError(CorruptBlockError):
    """The byte length disagrees with what the header declares."""

    reason = "length"


class BadShapeError(CorruptBlockError):
    """The header's shape disagrees with the payload or with what the reader expects."""

    reason = "shape"


class ChecksumError(CorruptBlockError):
    """The checksum over header and body does not match."""

    reason = "checksum"


class KeyMismatchError(CorruptBlockError):
    """A valid block read for one key carries another key in its header.

    Stored under the wrong key by a bug, a race, a moved file or a writer:
    its KV belongs to other tokens, so it must never be loaded.
    """

    reason = "key_mismatch"


class ProvenanceError(CorruptBlockError):
    """A block's provenance trailer is malformed, or its tag does not verify.

    The trailer names who wrote the block (:mod:`kvtier.provenance`); a tag
    that does not verify means the block, its writer's name or the key it is
    stored under changed after it was stamped.
    """

    reason = "provenance"
