"""Running the server: ``serve_forever`` (the CLI) and ``BackgroundServer`` (a thread, for embedding and tests).

Shutdown (SIGTERM, or SIGINT/Ctrl-C): the server stops accepting
connections and answers 503 to new requests on open ones, lets in-flight
requests finish for up to ``graceful_timeout_s`` seconds, cancels what is
left (each cancelled request is aborted in the engine), and only then shuts
the engine down, so its KV connector flushes pending writes. A second
signal exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import Any

import click
import uvicorn
from fastapi import FastAPI

from kvtier.engine.config import EngineConfig
from kvtier.engine.server.app import create_app
from kvtier.engine.server.state import ServerLimits, ServerState
from kvtier.net import bind_listener
from kvtier.progress import Stage


@dataclass(frozen=True)
class ServeOptions:
    """How ``kvtier engine serve`` listens.

    Attributes:
        host: Address to bind (``127.0.0.1`` keeps the server local).
        port: TCP port; 0 picks a free one.
        served_model_name: The model name clients send; default the engine's model id.
        max_concurrent_requests: In-flight generation requests beyond which the server answers 429.
        graceful_timeout_s: How long shutdown waits for in-flight requests.
        log_level: uvicorn's log level.
        role: ``both``; ``prefill`` (a request's final answer waits until its KV
            saves reached the connector's store) or ``decode`` under P/D disaggregation.
        api_key: Clients must send ``Authorization: Bearer <api_key>`` (all
            routes but ``/health`` and ``/metrics``); ``None``: no key needed.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    max_concurrent_requests: int = 256
    graceful_timeout_s: float = 30.0
    log_level: str = "warning"
    role: str = "both"
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.graceful_timeout_s < 0:
            raise ValueError("graceful_timeout_s must be >= 0")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")


_SIGNALS = (signal.SIGINT, signal.SIGTERM)
ROLES = ("both", "prefill", "decode")


class _Server(uvicorn.Server):
    """uvicorn's server that also marks the app as shutting down on the first signal."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self._state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._state.shutting_down = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Routes SIGINT/SIGTERM to ``handle_exit`` while serving.

        NOTE: uvicorn's own version re-raises the signal after the server
        stops, which kills the process before the engine is shut down (and
        its connector flushed); this one returns normally instead.
        """
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def _uvicorn_config(app: FastAPI, options: ServeOptions) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        log_level=options.log_level,
        timeout_graceful_shutdown=int(options.graceful_timeout_s)
        if options.graceful_timeout_s
        else None,
        lifespan="off",
        access_log=False,
    )


def build_engine(config: EngineConfig, role: str = "both") -> Any:
    """Starts a ``ProcessEngine``: the engine core in its own process, model loaded.

    A ``prefill`` engine holds each final answer until its KV saves reached the store.

    Raises:
        EngineError: if the engine cannot start.
    """
    from kvtier.engine.process_engine import ProcessEngine

    return ProcessEngine(config, flush_saves_on_finish=role == "prefill").start()


def serve_forever(config: EngineConfig, options: ServeOptions, *, quiet: bool = False) -> None:
    """Loads the model, serves until SIGTERM/SIGINT, then shuts down gracefully.

    Raises:
        EngineError: if the engine cannot start (bad model, bad config...).
        OSError: if the address cannot be bound.
    """
    from pathlib import Path

    sock = bind_listener(options.host, options.port)
    try:
        with Stage(f"loading {Path(config.model).name}", enabled=not quiet):
            engine = build_engine(config, options.role)
        try:
            app = create_app(
                engine,
                served_model_name=options.served_model_name,
                limits=ServerLimits(max_concurrent_requests=options.max_concurrent_requests),
                api_key=options.api_key,
                role=options.role,
            )
            state: ServerState = app.state.kvtier
            host, port = sock.getsockname()[:2]
            if not quiet:
                capacity = getattr(engine, "capacity", None)
                if capacity is not None:
                    click.echo(f"{capacity}; dtype {capacity.dtype}", err=True)
                key = "API key required" if options.api_key is not None else "no API key"
                click.echo(
                    f"serving {state.served_model_name!r} on http://{host}:{port} "
                    f"(OpenAI API under /v1, {key}; /health, /metrics); Ctrl-C or SIGTERM stops",
                    err=True,
                )
            server = _Server(_uvicorn_config(app, options), state)
            server.run(sockets=[sock])
        finally:
            if not quiet:
                click.echo("shutting the engine down…", err=True)
            engine.shutdown()
    finally:
        sock.close()


class BackgroundServer:
    """Serves an app on a background thread (its own event loop) until closed.

    For embedding the server in another program and for tests. No signal
    handlers are installed; ``close()`` performs the same graceful shutdown.

    Args:
        app: From ``create_app``.
        host: Address to bind.
        port: 0 picks a free port (see ``url``).
        graceful_timeout_s: How long ``close()`` waits for in-flight requests.
    """

    def __init__(
        self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, graceful_timeout_s: float = 5.0
    ) -> None:
        self._sock = bind_listener(host, port)
        self.host, self.port = self._sock.getsockname()[:2]
        self._state: ServerState = app.state.kvtier
        options = ServeOptions(host=host, port=self.port, graceful_timeout_s=graceful_timeout_s)
        self._server = _Server(_uvicorn_config(app, options), self._state)
        self._thread = threading.Thread(target=self._run, name="kvtier-http", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        """``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    @property
    def state(self) -> ServerState:
        """The app's shared state (in-flight count, shutdown flag)."""
        return self._state

    def _run(self) -> None:
        try:
            asyncio.run(self._server.serve(sockets=[self._sock]))
        except Exception as e:  # reported by start() on the caller's thread
            self._error = e

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        """Starts serving; returns once the server accepts connections.

        Raises:
            RuntimeError: if it does not start within ``timeout_s``.
        """
        self._thread.start()
        deadline = threading.Event()
        waited = 0.0
        while not self._server.started and self._thread.is_alive() and waited < timeout_s:
            deadline.wait(0.02)
            waited += 0.02
        if not self._server.started:
            self.close()
            raise RuntimeError(f"the HTTP server did not start: {self._error!r}")
        return self

    def close(self, timeout_s: float = 30.0) -> None:
        """Graceful shutdown (idempotent); the engine is left to its owner."""
        self._state.shutting_down = True
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
