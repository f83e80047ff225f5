"""The cache server process: a store, the gRPC service, the data plane, the HTTP frontend, and their lifecycle.

::

    CacheServer.start()   store built · stats history sampling · gRPC bound · data plane bound ·
                          HTTP bound · ready
    CacheServer.stop()    not ready · new calls refused (both planes) · calls and transfers in
                          flight finish (grace) · store closed (background writes flushed) ·
                          HTTP closed

``kvtier serve`` runs one until SIGTERM or SIGINT, then stops it gracefully:
a Put stream being received when the signal arrives is finished and stored
(within ``shutdown_grace_s``).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from kvtier.block import read_header
from kvtier.config import KvtierConfig
from kvtier.errors import ConfigError, CorruptBlockError
from kvtier.factory import build_store
from kvtier.metrics import StoreMetrics
from kvtier.server.access import BlockAccess, provenance_secret
from kvtier.server.dataplane import DataPlaneServer, server_tls_context
from kvtier.server.deadlines import Reaper
from kvtier.server.gate import Gate
from kvtier.server.http import HttpAccess, HttpFrontend
from kvtier.server.metrics import ServerMetrics
from kvtier.server.service import KvCacheService
from kvtier.server.stats import History, StatsSource, dashboard_json
from kvtier.server.tenants import Tenant, TenantDirectory
from kvtier.server_config import ServerConfig, is_loopback
from kvtier.store import TieredStore
from kvtier.tier_events import TierEventLog
from kvtier.wire.transport import channel_options

log = logging.getLogger(__name__)


def _read(path: Any, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"server.tls.{what}: cannot read {path}: {e.strerror or e}") from None


class CacheServer:
    """One kvtier cache server.

    Args:
        config: The ``server:`` section.
        store_config: The store to build (tiers, write policy); defaults if
            ``None`` and no ``store`` is given.
        store: A store to serve instead of building one (the server closes
            it on stop); its metrics registry becomes the server's.
    """

    def __init__(
        self,
        config: ServerConfig,
        store_config: KvtierConfig | None = None,
        *,
        store: TieredStore | None = None,
    ) -> None:
        if store is not None and store_config is not None:
            raise ValueError("give store_config or store, not both")
        self.config = config
        if store is not None:
            self.store = store
            self.store_metrics = store.metrics
            self.registry = store.metrics.registry
        else:
            self.registry = CollectorRegistry()
            self.store_metrics = StoreMetrics(self.registry)
            self.store = build_store(store_config or KvtierConfig(), self.store_metrics)
        self.metrics = ServerMetrics(self.registry)
        self.directory = TenantDirectory(config)
        self.gate = Gate(self.directory, config, self.metrics)
        self.access = BlockAccess(
            self.store,
            self.directory,
            self.metrics,
            provenance_secret(config.provenance_key_file),
        )
        self.store.put_wait_s = config.store_put_wait_s
        self.tier_events = TierEventLog()
        """Blocks stored and removed, for routers (``GET /tier_events``, docs/router.md)."""
        self.access.events = self.tier_events
        # NOTE: a block evicted from the last tier has left the server (one evicted from an
        # upper tier is still below it, or is being written down). The store gives the last
        # tier no listener of its own (write-back writes down from the upper ones only).
        # A memory tier hands over the block (its header names the client's key); a disk
        # tier only the key, so that it reads nothing: the log remembers the client's key.
        last = self.store.tiers[-1]
        if last.fast:
            last.set_eviction_listener(self._evicted)
        else:
            last.set_evicted_key_listener(self.tier_events.evicted)
        shared = [t.name for t in self.store.tiers if not t.verifies_reads]
        if shared:
            # NOTE: blocks read back from storage others can write must carry our stamp;
            # our memory and our private disk directory are not hashed again.
            self.store.block_check = self.access.check_stamp
            if config.provenance_key_file is None:
                log.warning(
                    "tiers %s are checked for this server's provenance stamps, whose key is "
                    "random for this process: blocks stored there before a restart will be "
                    "refused after it; set server.provenance_key_file",
                    shared,
                )
        self.history = History(StatsSource(self.registry, self.store), config.history_s)
        self._reaper: Reaper | None = None
        self.service = KvCacheService(
            self.access, self.gate, config, self.metrics, self.history, self._start_reaper()
        )
        self._grpc: grpc.Server | None = None
        self._data: DataPlaneServer | None = None
        self._http: HttpFrontend | None = None
        self._ready = False
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self.port = 0
        self.http_port: int | None = None
        self.data_port: int | None = None

    def _evicted(self, scoped: bytes, block: bytes) -> None:
        """The last tier evicted ``block``: recorded under the client's key its header carries."""
        try:
            key = read_header(block).key
        except CorruptBlockError:
            return  # not a block this server wrote: no client key to report
        self.tier_events.record("removed", [(scoped, key)])

    def _start_reaper(self) -> Reaper:
        self._reaper = Reaper(lambda reason: self.metrics.cancelled_calls.labels(reason).inc())
        return self._reaper

    @property
    def ready(self) -> bool:
        """True from the end of :meth:`start` until :meth:`stop` begins."""
        return self._ready and not self.service.draining

    @property
    def address(self) -> str:
        """``host:port`` of the gRPC service (after :meth:`start`)."""
        host = self.config.host
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{self.port}"

    def start(self) -> CacheServer:
        """Bind and start serving.

        Raises:
            ConfigError: a port cannot be bound or the TLS files cannot be read.
        """
        c = self.config
        try:
            self.history.start()
            server = grpc.server(
                futures.ThreadPoolExecutor(max_workers=c.threads, thread_name_prefix="kvtier-grpc"),
                options=channel_options(c.max_message_size),
                maximum_concurrent_rpcs=c.max_concurrent_rpcs,
            )
            server.add_generic_rpc_handlers((self.service.generic_handler(),))
            bind = f"[{c.host}]:{c.port}" if ":" in c.host else f"{c.host}:{c.port}"
            try:
                if c.tls is not None:
                    creds = grpc.ssl_server_credentials(
                        [(_read(c.tls.key_file, "key_file"), _read(c.tls.cert_file, "cert_file"))]
                    )
                    self.port = server.add_secure_port(bind, creds)
                else:
                    self.port = server.add_insecure_port(bind)
            except RuntimeError as e:
                raise ConfigError(f"server: cannot bind gRPC to {bind}: {e}") from None
            if not self.port:
                raise ConfigError(f"server: cannot bind gRPC to {bind}")
            server.start()
            self._grpc = server
            if c.data_port is not None:
                tls = (
                    server_tls_context(c.tls.cert_file, c.tls.key_file)
                    if c.tls is not None
                    else None
                )
                self._data = DataPlaneServer(c, self.access, self.gate, self.metrics, tls).start()
                self.data_port = self._data.port
                self.service.data_port = self._data.port
            if c.http_port is not None:
                http_host = c.http_host or c.host
                try:
                    self._http = HttpFrontend(
                        http_host,
                        c.http_port,
                        self.registry,
                        self.dashboard_stats,
                        lambda: self.ready,
                        HttpAccess(self.directory, c.http_role) if c.http_require_token else None,
                        timeout_s=c.http_timeout_s,
                        max_threads=c.http_max_threads,
                        tier_events=self.tier_events,
                    )
                except OSError as e:
                    raise ConfigError(
                        f"server: cannot bind HTTP to {http_host}:{c.http_port}: {e.strerror or e}"
                    ) from None
                self._http.start()
                self.http_port = self._http.port
                if not c.http_require_token and not is_loopback(http_host):
                    log.warning(
                        "the dashboard, /api/stats and /metrics on %s:%s need no token (they show "
                        "tenant names and traffic); set server.http_require_token: true",
                        http_host,
                        self.http_port,
                    )
        except BaseException:
            self.stop(grace=0)
            raise
        self._ready = True
        self.metrics.ready.set(1)
        log.info(
            "kvtier cache server on %s (%s, %s), data plane %s, http %s",
            self.address,
            "TLS" if c.tls else "plaintext",
            "open" if c.is_open else f"{len(c.tenants)} tenants",
            self.data_port,
            self.http_port,
        )
        return self

    def dashboard_stats(self, viewer: Tenant | None = None) -> dict[str, Any]:
        """The ``/api/stats`` document (``viewer``: who asks; only its own tenant row unless
        it sees every tenant's; ``None``: an HTTP side without tokens, everything)."""
        return dashboard_json(
            self.history,
            viewer=None if viewer is None or viewer.sees_everyone else viewer.label,
            meta={
                "version": self.service.version,
                "ready": self.ready,
                "open": self.config.is_open,
                "uptime_s": time.time() - self.service.started,
                "address": self.address,
                "data_port": self.data_port,
            },
        )

    def stop(self, grace: float | None = None) -> None:
        """Drain and stop; idempotent and safe from any thread.

        Args:
            grace: Seconds calls in flight may take to finish
                (``shutdown_grace_s`` if ``None``); then they are cancelled.
        """
        with self._stop_lock:
            if self._stopped.is_set():
                return
            grace = self.config.shutdown_grace_s if grace is None else grace
            self._ready = False
            self.metrics.ready.set(0)
            self.service.drain()
            grpc_stopped = self._grpc.stop(grace) if self._grpc is not None else None
            if self._data is not None:
                self._data.stop(grace)  # in parallel with gRPC's grace
            if grpc_stopped is not None and not grpc_stopped.wait(grace + 10.0):
                log.warning("gRPC handlers still running %.0f s after the grace period", 10.0)
            if not self.service.wait_idle(timeout=max(grace, 1.0)):
                log.warning("calls still running after the grace period; closing the store anyway")
            self.history.close()
            if self._reaper is not None:
                self._reaper.close()
            self.store.close()
            if self._http is not None:
                self._http.close()
            self._stopped.set()
            log.info("kvtier cache server stopped")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until stopped; ``False`` on timeout."""
        return self._stopped.wait(timeout)

    def __enter__(self) -> CacheServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop(grace=5.0)
