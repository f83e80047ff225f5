"""``return_token_ids``: every choice and every streamed chunk carries its token ids (as vLLM),
which is how the router continues a stream on another engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.test_server import Stack, start_stack, stream

GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 24}


@pytest.fixture(scope="module")
def stack(tiny_llama: Path) -> Iterator[Stack]:
    s = start_stack(tiny_llama)
    yield s
    s.close()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_chunks_carry_every_token_id_and_the_answer_lists_them(
    stack: Stack, path: str
) -> None:
    chat = path.endswith("chat/completions")
    prompt = (
        {"messages": [{"role": "user", "content": "Tokens, please"}]}
        if chat
        else {"prompt": "Tokens, please"}
    )
    whole = stack.client.post(path, json={**prompt, **GREEDY, "return_token_ids": True}).json()
    ids = whole["choices"][0]["token_ids"]
    assert len(ids) == GREEDY["max_tokens"]
    text = whole["choices"][0]["message"]["content"] if chat else whole["choices"][0]["text"]
    assert stack.engine.tokenizer.decode(ids) == text
    events = stream(stack.client, path, {**prompt, **GREEDY, "return_token_ids": True})
    chunks = [e for e in events[:-1] if e["choices"]]
    streamed = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    assert streamed == ids
    # without the option the chunks do not carry them
    plain = stream(stack.client, path, {**prompt, **GREEDY})
    assert all("token_ids" not in c["choices"][0] for c in plain[:-1] if c["choices"])
    plain_whole = stack.client.post(path, json={**prompt, **GREEDY}).json()
    assert "token_ids" not in plain_whole["choices"][0]
