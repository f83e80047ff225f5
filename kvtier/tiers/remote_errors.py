"""gRPC status codes of the cache server mapped onto kvtier's error kinds.

=============================================  ==================================  =========
status                                         kvtier error                        retried
=============================================  ==================================  =========
UNAVAILABLE, DEADLINE_EXCEEDED,                :class:`RemoteRetryableError`       yes
RESOURCE_EXHAUSTED, ABORTED, CANCELLED         (a ``TransientError``)
INTERNAL, UNKNOWN, DATA_LOSS                   :class:`RemoteServerError`          no
                                               (a ``TransientError``)
UNAUTHENTICATED, PERMISSION_DENIED             :class:`RemoteAuthError`            no
                                               (``AuthError`` and ``ConfigError``)
INVALID_ARGUMENT, UNIMPLEMENTED, anything      :class:`RemoteProtocolError`        no
else                                           (a ``ConfigError``)
=============================================  ==================================  =========

The data plane's STATUS codes are gRPC's numbers and map the same way
(:func:`error_for_status`). :class:`DataPlaneUnavailableError` never leaves
the tier: it makes a call fall back to gRPC.

Transient errors count against the circuit breaker; the others do not (a
wrong token says nothing about the server's health). ``RESOURCE_EXHAUSTED``
is transient because the client never exceeds the static limits it learned
from the server's Health answer, so the ones it sees are the dynamic kind
(bytes in flight, concurrent calls).
"""

from __future__ import annotations

import grpc

from kvtier.errors import AuthError, ConfigError, TransientError


class RemoteRetryableError(TransientError):
    """The call failed in a way that may succeed if repeated (the server is busy or unreachable)."""


class RemoteServerError(TransientError):
    """The server failed the call (a server-side fault); not retried, counted by the breaker."""


class RemoteAuthError(AuthError, ConfigError):
    """The server refused the token (UNAUTHENTICATED) or the tenant's role (PERMISSION_DENIED)."""


class RemoteProtocolError(ConfigError):
    """Client and server disagree on the protocol: a request the server calls
    malformed, a method it does not know, or an answer that breaks the protocol."""


class DataPlaneUnavailableError(TransientError):
    """The data plane cannot be used now (no connection, a refused or failed
    handshake, another protocol version); the tier falls back to gRPC."""


_RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
    }
)
_SERVER = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS})
_AUTH = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})


def map_rpc_error(e: grpc.RpcError, tier: str, op: str) -> Exception:
    """The kvtier error for a failed call (to raise ``from None``)."""
    code = e.code() if isinstance(e, grpc.Call) else None
    details = (e.details() if isinstance(e, grpc.Call) else None) or str(e)
    name = code.name if code is not None else "UNKNOWN"
    return error_for_status(code, f"remote tier {tier!r}: {op} failed with {name}: {details}")


_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode | None:
    """The gRPC status of a number (as the data plane sends it); ``None`` if unknown."""
    return _BY_NUMBER.get(number)


def error_for_status(code: grpc.StatusCode | None, message: str) -> Exception:
    """The kvtier error for a status (``None``: unknown), per the table above."""
    if code in _RETRYABLE:
        return RemoteRetryableError(message)
    if code in _AUTH:
        return RemoteAuthError(message)
    if code in _SERVER or code is None:
        return RemoteServerError(message)
    return RemoteProtocolError(message)
