"""``PreparedPrompt`` and ``prepare_prompt``: a request validated and tokenized, ready to queue.

Shared by the in-process engine (``LLMEngine.prepare``) and the engine-core
client (``ProcessEngine``), which validates in the API process so a bad
request is rejected before it crosses to the engine process.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.engine.errors import InvalidRequestError
from kvtier.engine.sampling_params import SamplingParams
from kvtier.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class PreparedPrompt:
    """A validated, tokenized request, ready to be queued."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


def prepare_prompt(
    tokenizer: Tokenizer,
    vocab_size: int,
    max_model_len: int,
    prompt: str | Sequence[int],
    params: SamplingParams | None = None,
    request_id: str | None = None,
) -> PreparedPrompt:
    """Validates and tokenizes a request (thread-safe).

    Raises:
        InvalidRequestError: for a bad prompt, bad parameters or a request
            that cannot fit in ``max_model_len``.
    """
    params = params if params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("params must be a SamplingParams", "params")
    params.validate(vocab_size)
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
        ids = list(prompt)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not (0 <= t < vocab_size):
                raise InvalidRequestError(
                    f"prompt token ids must be integers in [0, {vocab_size}), got {t!r}", "prompt"
                )
    else:
        raise InvalidRequestError("prompt must be a string or a list of token ids", "prompt")
    if not ids:
        raise InvalidRequestError("prompt is empty", "prompt")
    if len(ids) > max_model_len - 1:
        raise InvalidRequestError(
            f"prompt has {len(ids)} tokens; at most {max_model_len - 1} fit "
            f"(max_model_len {max_model_len} leaves room for one generated token)",
            "prompt",
        )
    if len(ids) + params.max_tokens > max_model_len:
        raise InvalidRequestError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"max_model_len ({max_model_len}); lower max_tokens to at most {max_model_len - len(ids)}",
            "max_tokens",
        )
    if request_id is None:
        request_id = uuid.uuid4().hex
    elif not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError("request_id must be a non-empty string", "request_id")
    return PreparedPrompt(request_id, ids, params)
