"""What the engine hands back: per-request outputs and engine-wide statistics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one generated token.

    Attributes:
        token_id: The chosen token.
        token: Its text on its own (may be a partial UTF-8 sequence rendered
            with replacement characters; use ``token_bytes`` for exact bytes).
        token_bytes: The token's raw bytes when the tokenizer is byte-level,
            else its UTF-8 encoded text.
        logprob: log p(token) under the model's raw distribution (before
            temperature, top-k and top-p).
        top_logprobs: The most likely alternatives, ``(token_id, logprob)``,
            most likely first.
    """

    token_id: int
    token: str
    token_bytes: bytes
    logprob: float
    top_logprobs: list[tuple[int, float]]


@dataclass
class RequestOutput:
    """The state of one request after an engine step.

    ``token_ids`` and ``text`` hold everything generated so far; the
    ``delta_*`` fields hold only what this step added, so a streaming client
    can concatenate ``delta_text`` and obtain ``text``.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_external_tokens: int
    ttft_s: float | None = None
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None


@dataclass
class EngineStats:
    """Engine counters (cumulative since start) and gauges (current)."""

    num_waiting: int = 0
    num_running: int = 0
    num_loading: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached_free: int = 0
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    external_query_tokens: int = 0
    external_matched_tokens: int = 0
    external_loaded_tokens: int = 0
    load_failures: int = 0
    recomputed_after_load_failure_tokens: int = 0
    connector_errors: int = 0
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_finished: int = 0
    num_aborted: int = 0
