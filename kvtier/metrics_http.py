"""``metrics.port``: a Prometheus endpoint for a process that runs the kvtier connector.

``kvtier engine serve`` already shows the connector's metrics on its own
``/metrics``; this endpoint is for the other places a connector runs — an
engine embedded in a Python program (``LLM(..., kv_connector="kvtier")``),
a benchmark, another engine's worker. It is prometheus_client's WSGI server
on a daemon thread, serving one registry at ``/metrics``, with no
authentication: it binds ``metrics.host`` (127.0.0.1 by default).
"""

from __future__ import annotations

import logging
import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from kvtier.config import MetricsConfig
from kvtier.errors import ConfigError

log = logging.getLogger(__name__)


class MetricsEndpoint:
    """``http://host:port/metrics`` for one registry, until :meth:`close`.

    Args:
        registry: What it serves.
        host: Bind address.
        port: Bind port (0: any free port; see :attr:`port`).

    Raises:
        ConfigError: the address cannot be bound (the message names ``metrics.port``).
    """

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        try:
            server, thread = start_http_server(port, addr=host, registry=registry)
        except OSError as e:
            raise ConfigError(
                f"metrics.port: cannot serve /metrics on {host}:{port}: {e.strerror or e}"
            ) from None
        self._server: WSGIServer = server
        self._thread: threading.Thread = thread
        self.host = host
        self.port: int = server.server_port
        self._closed = False
        log.info("kvtier metrics at http://%s:%d/metrics", host, self.port)

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stops serving and frees the port (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(config: MetricsConfig, registry: CollectorRegistry) -> MetricsEndpoint | None:
    """The endpoint ``config`` asks for, started; ``None`` when ``metrics.port`` is unset.

    Raises:
        ConfigError: the address cannot be bound.
    """
    if config.port is None:
        return None
    return MetricsEndpoint(registry, config.host, config.port)
