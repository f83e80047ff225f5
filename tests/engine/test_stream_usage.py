"""``stream_options.continuous_usage_stats``: usage on every streamed chunk (as vLLM sends it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engine.test_server import Stack, start_stack, stream

GREEDY = {"temperature": 0, "ignore_eos": True}
COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: prefix cache


def _counts(usage: dict[str, Any]) -> tuple[int, ...]:
    return tuple(usage[k] for k in COUNTS)


MESSAGES = [{"role": "user", "content": "What is a KV cache?"}]


@pytest.fixture(scope="module")
def stack(tiny_llama: Path) -> Iterator[Stack]:
    s = start_stack(tiny_llama)
    yield s
    s.close()


def _check_running_usage(chunks: list[dict[str, Any]], prompt_tokens: int, total: int) -> None:
    """Every chunk's usage counts its prompt and the tokens generated so far, never fewer."""
    completion = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"]["prompt_tokens"] == prompt_tokens for c in chunks)
    assert all(
        c["usage"]["total_tokens"] == prompt_tokens + c["usage"]["completion_tokens"]
        for c in chunks
    )
    assert completion == sorted(completion) and completion[-1] == total
    assert len(set(completion)) > 1  # it grows while streaming, not one total repeated


@pytest.mark.parametrize("include_usage", [True, False])
def test_chat_chunks_carry_usage_so_far(stack: Stack, include_usage: bool) -> None:
    body = {"messages": MESSAGES, "max_tokens": 8, **GREEDY}
    whole = stack.client.post("/v1/chat/completions", json=body).json()["usage"]
    options = {"continuous_usage_stats": True, "include_usage": include_usage}
    events = stream(stack.client, "/v1/chat/completions", {**body, "stream_options": options})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    with_choices = [c for c in chunks if c["choices"]]
    assert with_choices[0]["choices"][0]["delta"]["role"] == "assistant"
    _check_running_usage(with_choices, whole["prompt_tokens"], 8)
    # the final usage-only chunk comes with include_usage, and only then
    finals = [c for c in chunks if not c["choices"]]
    assert [_counts(f["usage"]) for f in finals] == ([_counts(whole)] if include_usage else [])


def test_completion_chunks_carry_each_prompts_usage(stack: Stack) -> None:
    prompts = ["The quick brown fox", "def forward(self, x): return"]
    body = {"prompt": prompts, "max_tokens": 6, **GREEDY}
    whole = stack.client.post("/v1/completions", json=body).json()["usage"]
    singles = [
        stack.client.post("/v1/completions", json={**body, "prompt": p}).json()["usage"]
        for p in prompts
    ]
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = stream(stack.client, "/v1/completions", {**body, "stream_options": options})
    chunks = events[:-1]
    for i, single in enumerate(singles):
        mine = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        _check_running_usage(mine, single["prompt_tokens"], 6)
    assert chunks[-1]["choices"] == [] and _counts(chunks[-1]["usage"]) == _counts(whole)


def test_without_the_option_chunks_carry_no_usage(stack: Stack) -> None:
    body = {"prompt": "The quick brown fox", "max_tokens": 4, **GREEDY}
    events = stream(
        stack.client, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
    )
    chunks = events[:-1]
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"] is not None
