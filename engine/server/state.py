"""``ServerState``: what every route handler shares (engine, names, limits, in-flight slots)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from kvtier.engine.server.errors import APIError
from kvtier.engine.server.generation import EngineClient
from kvtier.engine.server.metrics import ServerMetrics


def engine_alive(engine: object) -> bool:
    """False once the engine says its loop is not running (``is_running``)."""
    return getattr(engine, "is_running", True) is not False


@dataclass(frozen=True)
class ServerLimits:
    """Bounds that keep one client from exhausting the server.

    Attributes:
        max_concurrent_requests: In-flight generation requests beyond which
            the server answers 429.
        max_body_bytes: Largest request body accepted (413 above it).
    """

    max_concurrent_requests: int = 256
    max_body_bytes: int = 8 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.max_concurrent_requests < 1:
            raise ValueError("max_concurrent_requests must be >= 1")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")


@dataclass
class ServerState:
    """Shared by all handlers of one app (single event loop; no locking needed).

    Attributes:
        engine: The engine.
        served_model_name: The name clients send and ``/v1/models`` lists.
        registries: Prometheus registries ``/metrics`` exposes (the engine's
            first); the connector's is found at scrape time.
        metrics: The server's own HTTP metrics.
        limits: Request bounds.
        created: Unix time the server started (``/v1/models``).
        shutting_down: Set when a shutdown begins; new requests get 503.
        in_flight: Generation requests being served.
        role: ``both``, or ``prefill``/``decode`` under P/D disaggregation
            (``/health`` says which; ``docs/router.md``).
    """

    engine: EngineClient
    served_model_name: str
    registries: Sequence[CollectorRegistry]
    metrics: ServerMetrics
    limits: ServerLimits = field(default_factory=ServerLimits)
    created: int = field(default_factory=lambda: int(time.time()))
    shutting_down: bool = False
    in_flight: int = 0
    role: str = "both"

    @property
    def served_names(self) -> tuple[str, ...]:
        """Model names a request may use (the served name first, then the engine's model id)."""
        names = [self.served_model_name]
        if self.engine.model_id not in names:
            names.append(self.engine.model_id)
        return tuple(names)

    def acquire(self) -> Callable[[], None]:
        """Takes a generation slot; returns its (idempotent) release function.

        Raises:
            APIError: 503 while shutting down or when the engine stopped, 429
                when every slot is taken.
        """
        if self.shutting_down:
            raise APIError(503, "the server is shutting down", code="server_shutting_down")
        if not engine_alive(self.engine):
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        if self.in_flight >= self.limits.max_concurrent_requests:
            raise APIError(
                429,
                f"the server is busy ({self.in_flight} requests in flight); retry later",
                code="server_busy",
            )
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= 1
                self.metrics.in_flight.set(self.in_flight)

        return release
