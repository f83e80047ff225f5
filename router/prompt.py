"""A request's prompt token ids, exactly as the bundled engine will compute them.

The router parses the body with the engine server's own request models and
renders it with the engine's own input code (``kvtier.engine.server.inputs``:
the chat template, then ``encode`` without special tokens for a chat; ``encode``
for a completion), so the ids, and with them the keys, are the engine's.
A body the engine would refuse gives no ids: the request is routed without
keys and the engine answers the error.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvtier.engine.errors import EngineError
from kvtier.engine.fetch import lookup_known, resolve_model
from kvtier.engine.models.loader import load_tokenizer
from kvtier.engine.server.errors import APIError
from kvtier.engine.server.inputs import chat_inputs, completion_inputs
from kvtier.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from kvtier.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Only used to let the engine's input code run: the engine checks the length itself.
_NO_LENGTH_LIMIT = 1 << 30


def load_router_tokenizer(model: str) -> Tokenizer:
    """The tokenizer (and chat template) of a known model name, a ``.gguf`` or an HF directory.

    Raises:
        EngineError: if it cannot be loaded.
    """
    path = resolve_model(model) if lookup_known(model) else Path(model)
    return load_tokenizer(path)


def prompt_token_ids(tokenizer: Tokenizer, path: str, body: dict[str, Any]) -> list[int] | None:
    """The prompt of a ``/v1/chat/completions`` or ``/v1/completions`` body (the first
    prompt of a multi-prompt completion); None when the engine would refuse the body."""
    try:
        if path.endswith("/chat/completions"):
            chat = ChatCompletionRequest.model_validate(body)
            return chat_inputs(chat, tokenizer, _NO_LENGTH_LIMIT).prompts[0]
        completion = CompletionRequest.model_validate(body)
        return completion_inputs(completion, tokenizer, _NO_LENGTH_LIMIT).prompts[0]
    except (ValidationError, APIError, EngineError, ValueError, TypeError) as e:
        log.debug("no prompt ids for a %s body: %s", path, e)
        return None
