"""From an OpenAI request to engine inputs: prompt token ids and ``SamplingParams``.

Every check that can be made before the engine sees the request is made
here, so that a bad request is a 400 with a message in OpenAI's terms
(``context_length_exceeded``, ``param: "n"`` ...) rather than an engine error.
The engine validates again; its ``InvalidRequestError`` maps to a 400 too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from kvtier.engine.errors import InvalidRequestError
from kvtier.engine.sampling_params import SamplingParams
from kvtier.engine.server.errors import APIError, bad_request, from_invalid_request
from kvtier.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_PROMPTS = 32


class TokenizerLike(Protocol):
    """What the server needs of the engine's tokenizer."""

    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str: ...


@dataclass(frozen=True)
class EngineInputs:
    """Prompts (token ids, one per choice) and the sampling parameters they share."""

    prompts: list[list[int]]
    params: SamplingParams


def check_model(requested: str | None, served_names: tuple[str, ...]) -> None:
    """Raises a 404 ``model_not_found`` unless ``requested`` is one of the served names.

    An absent ``model`` means the served model.
    """
    if requested is None or requested in served_names:
        return
    raise APIError(
        404,
        f"The model {requested!r} does not exist; this server serves {served_names[0]!r} "
        "(see GET /v1/models)",
        param="model",
        code="model_not_found",
    )


def _check_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.n is not None and req.n != 1:
        raise bad_request(
            f"only n=1 is supported, got n={req.n}", param="n", code="unsupported_value"
        )
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value not in (None, 0, 0.0):
            raise bad_request(
                f"{name} is not supported (got {value}); leave it unset or 0",
                param=name,
                code="unsupported_parameter",
            )
    if req.logit_bias:
        raise bad_request(
            "logit_bias is not supported", param="logit_bias", code="unsupported_parameter"
        )
    if req.stream_options is not None and not req.stream:
        raise bad_request(
            "stream_options is only allowed when stream is true",
            param="stream_options",
            code="invalid_value",
        )


def _params(
    req: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    logprobs: int | None,
    vocab_size: int,
    renames: dict[str, str] | None = None,
) -> SamplingParams:
    """The request's ``SamplingParams``, validated.

    Args:
        renames: Engine field name -> request field name, so an error names
            the field the client sent (``max_completion_tokens``, ``top_logprobs``).
    """
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        max_tokens=max_tokens,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        seed=req.seed,
        logprobs=logprobs,
    )
    try:
        params.validate(vocab_size)
    except InvalidRequestError as e:
        err = from_invalid_request(e)
        err.param = (renames or {}).get(err.param or "", err.param)
        raise err from None
    return params


def _check_length(
    ids: list[int],
    max_tokens: int | None,
    max_model_len: int,
    label: str,
    max_tokens_field: str = "max_tokens",
) -> None:
    if not ids:
        param = "messages" if label == "conversation" else "prompt"
        raise bad_request(f"{label} is empty", param=param, code="invalid_value")
    if len(ids) >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{label} has {len(ids)} tokens, which leaves no room for a reply. "
            "Please shorten it.",
            param="messages" if label == "conversation" else "prompt",
            code="context_length_exceeded",
        )
    if max_tokens is not None and len(ids) + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the {label}, {max_tokens} "
            f"for the completion). Please reduce the {label} or max_tokens "
            f"(at most {max_model_len - len(ids)} here).",
            param=max_tokens_field,
            code="context_length_exceeded",
        )


def _check_ids(ids: list[int], vocab_size: int) -> list[int]:
    for t in ids:
        if t >= vocab_size:
            raise bad_request(
                f"prompt token id {t} is outside the vocabulary (size {vocab_size})",
                param="prompt",
                code="invalid_value",
            )
    return ids


def completion_inputs(
    req: CompletionRequest, tokenizer: TokenizerLike, max_model_len: int
) -> EngineInputs:
    """Prompts and parameters of a ``/v1/completions`` request.

    Raises:
        APIError: 400 for any unsupported option or a prompt that cannot fit.
    """
    _check_unsupported(req)
    if req.best_of not in (None, 1):
        raise bad_request(
            f"only best_of=1 is supported, got {req.best_of}",
            param="best_of",
            code="unsupported_value",
        )
    if req.echo:
        raise bad_request("echo is not supported", param="echo", code="unsupported_parameter")
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix", code="unsupported_parameter")
    p = req.prompt
    texts_or_ids: list[str | list[int]]
    if isinstance(p, str):
        texts_or_ids = [p]
    elif p and all(isinstance(x, int) for x in p):
        texts_or_ids = [list(p)]
    else:
        texts_or_ids = list(p)
    if not texts_or_ids:
        raise bad_request("prompt is empty", param="prompt", code="invalid_value")
    if len(texts_or_ids) > MAX_PROMPTS:
        raise bad_request(
            f"at most {MAX_PROMPTS} prompts per request, got {len(texts_or_ids)}",
            param="prompt",
            code="invalid_value",
        )
    vocab = tokenizer.vocab_size
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    params = _params(req, max_tokens, req.logprobs, vocab)
    prompts = []
    for i, item in enumerate(texts_or_ids):
        ids = tokenizer.encode(item) if isinstance(item, str) else _check_ids(item, vocab)
        label = "prompt" if len(texts_or_ids) == 1 else f"prompt {i}"
        _check_length(ids, max_tokens, max_model_len, label)
        prompts.append(ids)
    return EngineInputs(prompts, params)


def chat_inputs(
    req: ChatCompletionRequest, tokenizer: TokenizerLike, max_model_len: int
) -> EngineInputs:
    """The rendered conversation and parameters of a ``/v1/chat/completions`` request.

    Without ``max_tokens``/``max_completion_tokens`` the reply may use the
    rest of the context.

    Raises:
        APIError: 400 for any unsupported option or a conversation that cannot fit.
    """
    _check_unsupported(req)
    if req.tools:
        raise bad_request("tools are not supported", param="tools", code="unsupported_parameter")
    if req.tool_choice not in (None, "none", "auto"):
        raise bad_request(
            "tool_choice is not supported", param="tool_choice", code="unsupported_parameter"
        )
    fmt = (req.response_format or {}).get("type", "text")
    if fmt != "text":
        raise bad_request(
            f"response_format {fmt!r} is not supported (only 'text')",
            param="response_format",
            code="unsupported_parameter",
        )
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request(
            "top_logprobs needs logprobs to be true", param="top_logprobs", code="invalid_value"
        )
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in req.messages
    ]
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt
        )
    except InvalidRequestError as e:
        raise from_invalid_request(e) from None
    # NOTE: the template places any BOS text itself; do not add another.
    ids = tokenizer.encode(text, add_special_tokens=False)
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if field == "max_completion_tokens" else req.max_tokens
    renames = {"max_tokens": field, "logprobs": "top_logprobs"}
    _check_length(ids, requested, max_model_len, "conversation", field)
    max_tokens = requested if requested is not None else max_model_len - len(ids)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = _params(req, max_tokens, logprobs, tokenizer.vocab_size, renames)
    return EngineInputs([ids], params)
