"""From engine outputs to OpenAI response pieces: usage and logprobs."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.engine.outputs import RequestOutput, TokenLogprob
from kvtier.engine.server.inputs import TokenizerLike
from kvtier.engine.server.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptTokensDetails,
    TokenLogprobEntry,
    TopLogprob,
    Usage,
)


def usage_of(outputs: Sequence[RequestOutput]) -> Usage:
    """Token counts summed over the outputs of one request.

    ``prompt_tokens_details.cached_tokens`` counts prompt tokens whose KV was
    not computed: hits in the engine's own prefix cache plus tokens loaded by
    the KV connector (kvtier's shared tiers).
    """
    prompt = sum(o.num_prompt_tokens for o in outputs)
    completion = sum(len(o.token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens + o.num_external_tokens for o in outputs)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _token_text(tokenizer: TokenizerLike, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer: TokenizerLike, entries: Sequence[TokenLogprob]) -> ChatLogprobs:
    """Chat-style logprobs (``{"content": [...]}``) of some generated tokens."""
    content = []
    for e in entries:
        top = [
            TopLogprob(
                token=_token_text(tokenizer, tid),
                logprob=lp,
                bytes=list(tokenizer.token_bytes(tid)),
            )
            for tid, lp in e.top_logprobs
        ]
        content.append(
            TokenLogprobEntry(
                token=e.token, logprob=e.logprob, bytes=list(e.token_bytes), top_logprobs=top
            )
        )
    return ChatLogprobs(content=content)


def completion_logprobs(
    tokenizer: TokenizerLike, entries: Sequence[TokenLogprob], text_offset: int
) -> CompletionLogprobs:
    """Legacy completions logprobs of some generated tokens.

    Args:
        tokenizer: Turns alternative token ids into text.
        entries: Logprobs of consecutive generated tokens.
        text_offset: Character offset of the first entry's token in the completion.
    """
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset
    for e in entries:
        tokens.append(e.token)
        token_logprobs.append(e.logprob)
        top: dict[str, float] = {}
        for tid, lp in e.top_logprobs:
            # NOTE: distinct tokens can share a text (partial UTF-8 pieces all
            # render as U+FFFD); keep the most likely one, listed first.
            top.setdefault(_token_text(tokenizer, tid), lp)
        top_logprobs.append(top)
        offsets.append(offset)
        offset += len(e.token)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=offsets
    )
