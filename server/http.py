"""The server's HTTP side: ``/metrics``, ``/api/stats``, the dashboard, health and readiness.

Routes (GET only)::

    /               the dashboard page (server/static/dashboard.html)
    /static/<file>  its script and style sheet
    /api/stats      JSON figures and history (what the dashboard polls)
    /metrics        Prometheus text exposition of the server's registry
    /healthz        200 while the process serves HTTP (liveness)
    /readyz         200 while the gRPC service takes calls, 503 starting or draining
    /tier_events    blocks stored and removed, with a cursor (long poll; kvtier.tier_events)

A ``ThreadingHTTPServer`` in a daemon thread: no framework, no build step.
It exposes figures and tenant names, never blocks. By default it asks for no
token, so bind it (``http_host``) where only operators and Prometheus reach
it; with ``http_require_token`` every route but ``/healthz`` and ``/readyz``
needs the token of a tenant of at least ``http_role`` (:class:`HttpAccess`):

* ``Authorization: Bearer <token>`` — Prometheus (``authorization:`` in a
  scrape config), curl, scripts;
* ``Authorization: Basic base64(<any name>:<token>)`` — what a browser sends
  after asking for a user name and password (the 401 offers ``Basic``): the
  page, its script and its ``/api/stats`` polls then all carry it, so the
  dashboard needs no code of its own for this and the token never appears in
  a URL.

No token or an unknown one is a 401, a token of a lesser role a 403. A
tenant that does not see every tenant's figures (not admin, no
``sees_all_stats``) gets only its own row in ``/api/stats`` and only its own
series of the per-tenant metrics in ``/metrics``, as the Stats call does.

Bounded: a request must arrive within ``timeout_s`` (a half-sent one is
closed after it), and at most ``max_threads`` are served at once; a
connection beyond them is closed at once, so slow or silent clients cannot
pile up threads.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import mimetypes
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from kvtier.server.tenants import Tenant, TenantDirectory, UnknownTokenError, scope_key
from kvtier.server_config import Role
from kvtier.tier_events import TierEventLog, Visible, parse_query

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
"""Served without a token even when one is required (liveness and readiness probes)."""

_REALM = "kvtier cache server"


def presented_token(header: str | None) -> str | None:
    """The token of an ``Authorization`` header (Bearer, or Basic's password); ``None``: none."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer":
        return value or None
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        _, sep, password = decoded.partition(":")
        return password if sep and password else None
    return None


@dataclass(frozen=True)
class HttpAccess:
    """Who may read the HTTP side: a token of a tenant with at least ``role``.

    Attributes:
        directory: The server's tenants (the same tokens as gRPC).
        role: The least role admitted.
    """

    directory: TenantDirectory
    role: Role

    def refusal(self, header: str | None) -> tuple[int, str] | None:
        """``None`` when ``header`` (an ``Authorization`` value) admits; else (status, reason)."""
        return self.admit(header)[1]

    def admit(self, header: str | None) -> tuple[Tenant | None, tuple[int, str] | None]:
        """(the tenant ``header`` authenticates, ``None`` or the refusal (status, reason))."""
        token = presented_token(header)
        if token is None:
            return None, (
                401,
                "a token is required: send 'Authorization: Bearer <token>' "
                "(in a browser: any user name, the token as password)",
            )
        try:
            tenant = self.directory.by_token(token)
        except UnknownTokenError:
            return None, (401, "the token matches no tenant")
        if tenant is None or not tenant.may(self.role):
            role = tenant.role if tenant is not None else "none"
            return tenant, (403, f"tenant role {role} is below {self.role}, which this page needs")
        return tenant, None


class _OwnSeries:
    """A registry's metrics with only one tenant's series of the per-tenant ones."""

    _LABELS = ("tenant", "writer")

    def __init__(self, registry: CollectorRegistry, label: str) -> None:
        self._registry = registry
        self._label = label

    def collect(self) -> list[Metric]:
        out = []
        for m in self._registry.collect():
            keep = [
                s
                for s in m.samples
                if all(s.labels.get(k, self._label) == self._label for k in self._LABELS)
            ]
            if len(keep) != len(m.samples):
                m = Metric(m.name, m.documentation, m.type, m.unit)
                m.samples = keep
            out.append(m)
        return out


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer that serves at most ``max_threads`` requests at once."""

    daemon_threads = True
    request_queue_size = 128  # listen backlog (socketserver's 5 makes a burst wait on SYN retries)

    def __init__(self, address: tuple[str, int], handler: Any, max_threads: int) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_threads)
        self.refused = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)  # closed at once: no thread, no waiting
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class HttpFrontend:
    """Serves the routes above from a background thread.

    Args:
        host: Bind address.
        port: Bind port (0: any free port; see :attr:`port` after start).
        registry: What ``/metrics`` exposes.
        stats_json: Builds the ``/api/stats`` document for a viewer (``None``: no token).
        ready: Whether ``/readyz`` says ready.
        access: Who may read every route but ``/healthz`` and ``/readyz``;
            ``None``: anyone.
        timeout_s: A request must arrive within this (socket timeout).
        max_threads: Requests served at once; more connections are closed at once.
        tier_events: What ``/tier_events`` serves (``None``: 404).
    """

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        stats_json: Callable[[Tenant | None], dict[str, Any]],
        ready: Callable[[], bool],
        access: HttpAccess | None = None,
        *,
        timeout_s: float = 5.0,
        max_threads: int = 32,
        tier_events: TierEventLog | None = None,
    ) -> None:
        self._registry = registry
        self._tier_events = tier_events
        self._stats_json = stats_json
        self._ready = ready
        self._access = access
        frontend = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "kvtier"
            timeout = timeout_s  # the socket's: a half-sent request ends here

            def do_GET(self) -> None:
                frontend._route(self)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("http %s " + format, self.address_string(), *args)

        self._httpd = _BoundedHTTPServer((host, port), Handler, max_threads)
        self.host = host
        self.port: int = self._httpd.server_address[1]
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="kvtier-http", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _route(self, h: BaseHTTPRequestHandler) -> None:
        path = h.path.split("?", 1)[0]
        viewer: Tenant | None = None
        try:
            if self._access is not None and path not in OPEN_PATHS:
                viewer, refused = self._access.admit(h.headers.get("Authorization"))
                if refused is not None:
                    self._refuse(h, *refused)
                    return
            if path in ("/", "/index.html", "/dashboard"):
                self._file(h, STATIC_DIR / "dashboard.html")
            elif path.startswith("/static/"):
                name = path.removeprefix("/static/")
                target = STATIC_DIR / name
                if "/" in name or name.startswith(".") or not target.is_file():
                    self._send(h, 404, b"not found\n", "text/plain")
                else:
                    self._file(h, target)
            elif path == "/api/stats":
                body = json.dumps(self._stats_json(viewer), allow_nan=False).encode()
                self._send(h, 200, body, "application/json", cache=False)
            elif path == "/metrics":
                source: Any = self._registry
                if viewer is not None and not viewer.sees_everyone:
                    source = _OwnSeries(self._registry, viewer.label)
                self._send(h, 200, generate_latest(source), CONTENT_TYPE_LATEST, cache=False)
            elif path == "/tier_events" and self._tier_events is not None:
                self._events(h, self._tier_events, viewer)
            elif path == "/healthz":
                self._send(h, 200, b"ok\n", "text/plain", cache=False)
            elif path == "/readyz":
                ready = self._ready()
                self._send(
                    h,
                    200 if ready else 503,
                    b"ready\n" if ready else b"not ready\n",
                    "text/plain",
                    cache=False,
                )
            else:
                self._send(h, 404, b"not found\n", "text/plain")
        except (BrokenPipeError, ConnectionResetError):
            log.debug("http client went away during %s", path)

    def _events(self, h: BaseHTTPRequestHandler, log: TierEventLog, viewer: Tenant | None) -> None:
        """``/tier_events?after=N&log_id=ID&wait_s=S&limit=L``: a tenant that does not see
        everyone's figures sees the blocks of its own slots only."""
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(h.path).query)
        try:
            after, log_id, wait_s, limit = parse_query(query)
        except ValueError as e:
            self._send(h, 400, f"bad query: {e}\n".encode(), "text/plain", cache=False)
            return
        visible: Visible | None = None
        if viewer is not None and not viewer.sees_everyone:
            salts = viewer.read_salts
            visible = lambda scoped, key: any(scope_key(s, key) == scoped for s in salts)  # noqa: E731
        if wait_s > 0 and log_id in (None, log.log_id):
            log.wait(after, wait_s)
        body = json.dumps(log.read(after, log_id, limit, visible).to_json()).encode()
        self._send(h, 200, body, "application/json", cache=False)

    def _refuse(self, h: BaseHTTPRequestHandler, status: int, reason: str) -> None:
        log.debug("http %s refused %s: %s", h.address_string(), h.path, reason)
        body = (reason + "\n").encode()
        h.send_response(status)
        if status == 401:
            # Basic first: the scheme browsers can answer (they ask for a name and password)
            h.send_header("WWW-Authenticate", f'Basic realm="{_REALM}", charset="UTF-8"')
            h.send_header("WWW-Authenticate", f'Bearer realm="{_REALM}"')
        h.send_header("Content-Type", "text/plain; charset=utf-8")
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Cache-Control", "no-store")
        h.send_header("X-Content-Type-Options", "nosniff")
        h.end_headers()
        h.wfile.write(body)

    def _file(self, h: BaseHTTPRequestHandler, path: Path) -> None:
        ctype = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        if ctype.startswith("text/") or ctype.endswith("javascript"):
            ctype += "; charset=utf-8"
        self._send(h, 200, path.read_bytes(), ctype)

    def _send(
        self,
        h: BaseHTTPRequestHandler,
        status: int,
        body: bytes,
        ctype: str,
        *,
        cache: bool = True,
    ) -> None:
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(body)))
        if cache and self._access is not None:
            cache_control = "private, max-age=60"  # behind a token: never in a shared cache
        else:
            cache_control = "max-age=60" if cache else "no-store"
        h.send_header("Cache-Control", cache_control)
        h.send_header("X-Content-Type-Options", "nosniff")
        h.end_headers()
        h.wfile.write(body)
