"""Admission of requests: typed refusals with their gRPC status, key checks, the put byte budget.

Every refusal is a :class:`RequestError` carrying the status code the client
gets, a message that says what was wrong, and a bounded ``reason`` label for
``kvtier_server_rejected_total``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import grpc

KEY_SIZE = 16


class RequestError(Exception):
    """A request the server refuses; answered with ``code`` and ``message``.

    Args:
        code: The gRPC status code.
        message: What was wrong, for the client.
        reason: Metrics label (``invalid``, ``unauthenticated``, ``denied``,
            ``limit``, ``draining``).
    """

    def __init__(self, code: grpc.StatusCode, message: str, reason: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason


def invalid(message: str) -> RequestError:
    """A malformed request (INVALID_ARGUMENT)."""
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message, "invalid")


def over_limit(message: str) -> RequestError:
    """A request beyond a configured limit (RESOURCE_EXHAUSTED)."""
    return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, "limit")


def unauthenticated(message: str) -> RequestError:
    """No or an unknown token (UNAUTHENTICATED)."""
    return RequestError(grpc.StatusCode.UNAUTHENTICATED, message, "unauthenticated")


def denied(message: str) -> RequestError:
    """The tenant's role does not allow the call (PERMISSION_DENIED)."""
    return RequestError(grpc.StatusCode.PERMISSION_DENIED, message, "denied")


def draining() -> RequestError:
    """The server is shutting down (UNAVAILABLE: clients retry elsewhere or later)."""
    return RequestError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down", "draining")


def check_keys(keys: Sequence[bytes], max_keys: int) -> None:
    """Every key is 16 bytes and there are at most ``max_keys``.

    Raises:
        RequestError: RESOURCE_EXHAUSTED for too many keys, INVALID_ARGUMENT
            for a key of the wrong length (naming the first one).
    """
    if len(keys) > max_keys:
        raise over_limit(f"{len(keys)} keys in one call; this server takes at most {max_keys}")
    for i, k in enumerate(keys):
        if len(k) != KEY_SIZE:
            raise invalid(f"key #{i} is {len(k)} bytes; keys are exactly {KEY_SIZE} bytes")


class ByteBudget:
    """Bytes that may be reserved at once, all threads together (non-blocking).

    Put streams reserve a block's declared size before receiving it, so the
    memory held by half-received blocks is bounded however many clients
    stream at once.

    Args:
        capacity: Total bytes.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        with self._lock:
            return self._used

    def try_reserve(self, n: int) -> bool:
        """Reserve ``n`` bytes if they are free now; ``False`` otherwise."""
        with self._lock:
            if self._used + n > self.capacity:
                return False
            self._used += n
            return True

    def release(self, n: int) -> None:
        """Give back ``n`` reserved bytes."""
        with self._lock:
            self._used -= n
            assert self._used >= 0, "released more bytes than were reserved"
