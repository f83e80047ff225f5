"""API-key authentication of the OpenAI-compatible server (``kvtier engine serve --api-key``).

With a key configured, every request needs ``Authorization: Bearer <key>``
except ``GET /health`` and ``GET /metrics``, which stay open as in vLLM:
orchestrators probe the first and Prometheus scrapes the second, and neither
runs the model or shows a prompt. Everything else — ``/v1/*`` and unknown
paths alike — is refused with a 401 OpenAI-style body. (vLLM protects only
paths under ``/v1``; an allow-list of open paths cannot be bypassed by a path
spelled differently.)

The presented key and the configured one are compared as SHA-256 digests with
``hmac.compare_digest``: the time taken says nothing about how much of a
guess was right, nor about the key's length.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from kvtier.engine.server.errors import APIError

OPEN_PATHS = frozenset({"/health", "/metrics"})
"""Paths served without the API key."""


def _digest(text: str | bytes) -> bytes:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).digest()


def check_api_key(api_key: str) -> str:
    """The key itself, validated.

    Raises:
        ValueError: the key is empty, has surrounding whitespace, or characters
            an HTTP header cannot carry.
    """
    if not api_key:
        raise ValueError("the API key must not be empty")
    if api_key != api_key.strip():
        raise ValueError("the API key must not begin or end with whitespace")
    if not api_key.isascii() or not api_key.isprintable():
        raise ValueError("the API key must be printable ASCII (it travels in an HTTP header)")
    return api_key


class RequireApiKey:
    """Pure ASGI middleware: refuses requests without the right bearer key.

    Args:
        app: The wrapped application.
        api_key: The key clients must present.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._digest = _digest(check_api_key(api_key))

    def _authorized(self, scope: Scope) -> APIError | None:
        header = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value
                break
        scheme, _, presented = header.partition(b" ")
        if not header:
            return APIError(
                401,
                "no API key provided: send it as 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        if scheme.lower() != b"bearer":
            return APIError(
                401,
                "the Authorization header must be 'Bearer <key>'",
                code="invalid_api_key",
            )
        if not hmac.compare_digest(_digest(presented.strip()), self._digest):
            return APIError(401, "incorrect API key provided", code="invalid_api_key")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] in OPEN_PATHS
            or scope.get("method") == "OPTIONS"  # CORS preflights carry no credentials
        ):
            await self.app(scope, receive, send)
            return
        error = self._authorized(scope)
        if error is None:
            await self.app(scope, receive, send)
            return
        response = error.response()
        response.headers["WWW-Authenticate"] = 'Bearer realm="kvtier"'
        await response(scope, receive, send)
