"""The bundled engine's OpenAI-compatible HTTP server (FastAPI + uvicorn).

``create_app(engine)`` builds the app around a started ``AsyncLLMEngine``;
``serve_forever`` runs it the way ``kvtier engine serve`` does;
``BackgroundServer`` runs it on a thread. See docs/engine-server.md.
"""

from __future__ import annotations

from kvtier.engine.server.app import create_app
from kvtier.engine.server.errors import APIError
from kvtier.engine.server.runner import BackgroundServer, ServeOptions, serve_forever
from kvtier.engine.server.state import ServerLimits

__all__ = [
    "APIError",
    "BackgroundServer",
    "ServeOptions",
    "ServerLimits",
    "create_app",
    "serve_forever",
]
