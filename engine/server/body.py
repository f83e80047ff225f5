"""Reading a request body: bounded in size, parsed as JSON into a pydantic model."""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvtier.engine.server.errors import APIError, from_validation_error

M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing more than ``limit`` bytes (413) without reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(
            413, f"request body of {declared} bytes exceeds the limit of {limit}", code="too_large"
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(
                413, f"request body exceeds the limit of {limit} bytes", code="too_large"
            )
        chunks.append(chunk)
    return b"".join(chunks)


def parse_body(raw: bytes, model: type[M]) -> M:
    """Validates a JSON body against ``model``.

    Raises:
        APIError: 400 for an empty or malformed body, a wrong type, a missing
            or unknown field.
    """
    if not raw.strip():
        raise APIError(400, "request body is empty; send a JSON object", code="invalid_json")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise from_validation_error(e) from None
