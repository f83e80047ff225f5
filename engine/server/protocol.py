"""Request and response bodies of the OpenAI-compatible API (pydantic).

Requests are validated strictly: a wrong type is an error rather than a
silent coercion (``"max_tokens": "10"`` is rejected, as OpenAI does), and an
unknown field is an error naming it, except for a few fields OpenAI clients
send that do not change generation (``user``, ``metadata``, ``store`` ...),
which are accepted and ignored.

Extensions beyond OpenAI's schema: ``top_k``, ``stop_token_ids``,
``ignore_eos``; a prompt may be token ids; ``return_token_ids`` (as vLLM's):
every choice, and every streamed chunk, carries the ``token_ids`` it adds
(a chunk is sent for tokens that add no text yet, e.g. part of a UTF-8
character), which is how the router continues a stream on another engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

TokenIds = list[Annotated[int, Field(ge=0)]]
# NOTE: the order matters: a list of ints must not be read as a list of strings.
PromptInput = str | list[str] | TokenIds | list[TokenIds]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    """``stream_options`` (only with ``stream``).

    ``include_usage``: a final chunk with no choices carries the request's
    ``usage``. ``continuous_usage_stats``: every chunk with a choice carries
    the usage of that choice so far (its prompt, the tokens generated until
    then), as in vLLM — which needs ``include_usage`` too; here it works alone.
    """

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    return_token_ids: bool = False


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: PromptInput
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Strict):
    """One text part of a message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One message of a conversation."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _no_tool_fields(self) -> ChatMessage:
        extra = set(self.model_extra or {})
        if extra:
            raise ValueError(
                f"unsupported message field(s): {', '.join(sorted(extra))} "
                "(tool calls and non-text content are not supported)"
            )
        return self

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True


# ---- responses ------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    """``usage.prompt_tokens_details``: ``cached_tokens`` = engine prefix-cache + KV-connector hits."""

    cached_tokens: int


class Usage(BaseModel):
    """Token counts of a request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists per generated token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    """One choice of a completion (or one delta of a streamed one)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # with return_token_ids: the tokens of this choice (of this chunk, when streamed)
    token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)


class CompletionResponse(BaseModel):
    """A completion, or one chunk of a streamed completion (same object type)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    """An alternative token at one position."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(BaseModel):
    """Chat logprobs of one generated token."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """``choices[i].logprobs`` of a chat completion."""

    content: list[TokenLogprobEntry]


class AssistantMessage(BaseModel):
    """The reply."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatCompletionResponse(BaseModel):
    """A chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    """What one streamed chunk adds to the reply (``role`` only in the first chunk)."""

    role: Literal["assistant"] | None = Field(default=None, exclude_if=lambda v: v is None)
    content: str | None = None


class ChatChunkChoice(BaseModel):
    """One choice of a streamed chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvtier"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
