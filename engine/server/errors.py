"""The server's error model: every failure is an OpenAI-style JSON body with a 4xx/5xx status.

Body: ``{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}``.
``type`` is ``invalid_request_error`` for 4xx caused by the request and
``server_error`` for 5xx.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtier.engine.errors import InvalidRequestError

# Friendly descriptions of fields whose type is a union (pydantic reports one
# error per union member, which reads badly).
_UNION_FIELDS = {
    "prompt": "must be a string, a list of strings, a list of token ids (integers >= 0) "
    "or a list of token-id lists",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of text parts ({'type': 'text', 'text': ...})",
    "tool_choice": "must be a string or an object",
}


class APIError(Exception):
    """An error to send to the client as an OpenAI-style body.

    Attributes:
        status: HTTP status.
        message: What went wrong and, where possible, how to fix it.
        type: OpenAI error type.
        param: The offending request field, if any.
        code: A short machine-readable code, if any.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        """The JSON body."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        """The error as a response."""
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 about the request."""
    return APIError(400, message, param=param, code=code)


def from_invalid_request(e: InvalidRequestError) -> APIError:
    """Maps the engine's ``InvalidRequestError`` (it names the field) to a 400."""
    return bad_request(str(e), param=e.field, code="invalid_value")


def _loc_path(loc: tuple[int | str, ...]) -> tuple[str, str]:
    """(dotted path without union tags, top-level field)."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(str(item))
        elif "[" in item or item in ("str", "int", "float", "bool", "none"):
            break  # a union member tag: the rest describes one alternative
        else:
            parts.append(item)
    path = ".".join(parts)
    return path, parts[-1] if parts else ""


def from_validation_error(e: ValidationError | RequestValidationError) -> APIError:
    """Turns a pydantic validation error into one clear 400 (the first problem found)."""
    errors = e.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error") or first.get("msg", "")
        return bad_request(f"request body is not valid JSON: {detail}", code="invalid_json")
    loc = tuple(first.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    path, field = _loc_path(loc)
    if kind == "model_type" and not path:
        return bad_request("request body must be a JSON object", code="invalid_type")
    if kind == "extra_forbidden":
        return bad_request(
            f"Unrecognized request argument supplied: {path}", param=path, code="unknown_parameter"
        )
    if kind == "missing":
        return bad_request(
            f"missing required parameter: {path}", param=path, code="missing_required_parameter"
        )
    if field in _UNION_FIELDS and len(loc) > len(path.split(".")):
        return bad_request(f"{path} {_UNION_FIELDS[field]}", param=path, code="invalid_type")
    message = str(first.get("msg", "invalid value"))
    code = "invalid_type" if kind.endswith("_type") or kind == "literal_error" else "invalid_value"
    return bad_request(f"{path or 'body'}: {message}", param=path or None, code=code)


async def handle_api_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI handler for ``APIError``."""
    assert isinstance(exc, APIError)
    return exc.response()


async def handle_validation_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI handler for request validation (query/path parameters)."""
    assert isinstance(exc, RequestValidationError | ValidationError)
    return from_validation_error(exc).response()


async def handle_http_error(request: Request, exc: Exception) -> JSONResponse:
    """Unknown routes (404) and wrong methods (405) in the OpenAI shape."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = f"no such endpoint: {request.method} {request.url.path}"
        code = "not_found"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
        code = "method_not_allowed"
    else:
        message, code = str(exc.detail), None
    response = APIError(exc.status_code, message, code=code).response()
    if exc.headers:
        response.headers.update(exc.headers)
    return response
