"""Typed errors of the bundled engine.

Every failure the engine reports to a caller is one of these. Bad input from a
caller (a prompt too long, a sampling parameter out of range, a malformed
config) is an ``InvalidRequestError`` or ``EngineConfigError``; both subclass
``ValueError`` so callers that already catch ``ValueError`` keep working.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of all errors raised by ``kvtier.engine``."""


class InvalidRequestError(EngineError, ValueError):
    """A request (prompt or sampling parameters) is invalid.

    Attributes:
        field: The name of the offending field (``"max_tokens"``, ``"prompt"``,
            ...), or ``None`` when the error is not about one field.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class EngineConfigError(EngineError, ValueError):
    """An ``EngineConfig`` value or a model file's configuration is invalid or unsupported."""


class ModelLoadError(EngineError):
    """A model file or directory could not be read (missing, corrupt, unsupported tensor)."""


class ConnectorError(EngineError):
    """A KV connector could not be created (unknown name, bad import path, bad config).

    Failures of a working connector while loading or saving are never raised to
    the caller of the engine: they degrade to a recompute and are counted.
    """


class EngineDeadError(EngineError):
    """The engine's background loop stopped because of an unexpected error."""
