"""Chat templates rendered with a sandboxed jinja2 environment."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvtier.engine.errors import InvalidRequestError


class _TemplateRaised(Exception):
    """Raised by a template's ``raise_exception(...)`` call."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template.

    The environment is sandboxed and immutable: templates from model files
    cannot touch Python internals or mutate their inputs.
    """

    def __init__(self, source: str) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self._template = env.from_string(source)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        bos_token: str,
        eos_token: str,
        **kwargs: Any,
    ) -> str:
        """Renders ``messages`` to the model's prompt text.

        Raises:
            InvalidRequestError: if the messages are malformed or the template
                rejects them (e.g. roles that do not alternate).
        """
        validate_messages(messages)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=bos_token,
                eos_token=eos_token,
                **kwargs,
            )
        except _TemplateRaised as e:
            raise InvalidRequestError(
                f"chat template rejected the messages: {e}", "messages"
            ) from e
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template failed: {e}", "messages") from e


def validate_messages(messages: Any) -> None:
    """Checks that ``messages`` is a non-empty list of ``{"role": str, "content": ...}`` dicts.

    Raises:
        InvalidRequestError: naming the bad message.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequestError(f"messages[{i}] must be a dict", "messages")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise InvalidRequestError(f"messages[{i}] needs a non-empty string 'role'", "messages")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise InvalidRequestError(
                f"messages[{i}].content must be a string, a list of parts or null", "messages"
            )
