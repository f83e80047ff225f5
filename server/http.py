"""The server's HTTP side: ``/metrics``, ``/api/stats``, the dashboard, health and readiness.

Routes (GET only)::

    /               the dashboard page (server/static/dashboard.html)
    /static/<file>  its script and style sheet
    /api/stats      JSON figures and history (what the dashboard polls)
    /metrics        Prometheus text exposition of the server's registry
    /healthz        200 while the process serves HTTP (liveness)
    /readyz         200 while the gRPC service takes calls, 503 starting or draining

A ``ThreadingHTTPServer`` in a daemon thread: no framework, no build step.
The HTTP side carries no authentication — it exposes figures and tenant
names, never blocks — so bind it (``http_host``) where only operators and
Prometheus reach it.
"""

from __future__ import annotations

import json
import logging
import mimetypes
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"


class HttpFrontend:
    """Serves the routes above from a background thread.

    Args:
        host: Bind address.
        port: Bind port (0: any free port; see :attr:`port` after start).
        registry: What ``/metrics`` exposes.
        stats_json: Builds the ``/api/stats`` document.
        ready: Whether ``/readyz`` says ready.
    """

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        stats_json: Callable[[], dict[str, Any]],
        ready: Callable[[], bool],
    ) -> None:
        self._registry = registry
        self._stats_json = stats_json
        self._ready = ready
        frontend = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "kvtier"

            def do_GET(self) -> None:
                frontend._route(self)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("http %s " + format, self.address_string(), *args)

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
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
        try:
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
                body = json.dumps(self._stats_json(), allow_nan=False).encode()
                self._send(h, 200, body, "application/json", cache=False)
            elif path == "/metrics":
                self._send(
                    h, 200, generate_latest(self._registry), CONTENT_TYPE_LATEST, cache=False
                )
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

    def _file(self, h: BaseHTTPRequestHandler, path: Path) -> None:
        ctype = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        if ctype.startswith("text/") or ctype.endswith("javascript"):
            ctype += "; charset=utf-8"
        self._send(h, 200, path.read_bytes(), ctype)

    @staticmethod
    def _send(
        h: BaseHTTPRequestHandler, status: int, body: bytes, ctype: str, *, cache: bool = True
    ) -> None:
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Cache-Control", "max-age=60" if cache else "no-store")
        h.send_header("X-Content-Type-Options", "nosniff")
        h.end_headers()
        h.wfile.write(body)
