"""Bad input to the server: every case is a 4xx with an OpenAI-style error body, and the server stays up."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.engine.test_server import MODEL, Stack, start_stack
from tests.engine.tiny_models import write_tiny_model

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    path, _ = write_tiny_model(tmp_path_factory.mktemp("errors") / "tiny", "llama", seed=6)
    s = start_stack(path)
    yield s
    s.close()


def _c(**fields: Any) -> bytes:
    return json.dumps({"prompt": "hello", **fields}).encode()


def _chat(**fields: Any) -> bytes:
    return json.dumps({"messages": USER, **fields}).encode()


LONG = "fox " * 300  # ~300 tokens: more than max_model_len (256)

# (id, path, raw body, status, param, code, words in the message)
# fmt: off
CASES: list[tuple[str, str, bytes, int, str | None, str, str]] = [
    ("malformed-json", COMPLETIONS, b'{"prompt": "hi",', 400, None, "invalid_json", "not valid JSON"),
    ("empty-body", CHAT, b"", 400, None, "invalid_json", "body is empty"),
    ("not-an-object", COMPLETIONS, b'["hello"]', 400, None, "invalid_type", "must be a JSON object"),
    ("max-tokens-string", COMPLETIONS, _c(max_tokens="10"), 400, "max_tokens", "invalid_type", "valid integer"),
    ("temperature-string", CHAT, _chat(temperature="hot"), 400, "temperature", "invalid_type", "valid number"),
    ("stream-string", COMPLETIONS, _c(stream="yes"), 400, "stream", "invalid_type", "valid boolean"),
    ("prompt-mixed-list", COMPLETIONS, _c(prompt=[1, "a"]), 400, "prompt", "invalid_type", "list of token ids"),
    ("prompt-negative-id", COMPLETIONS, _c(prompt=[5, -1]), 400, "prompt", "invalid_type", "integers >= 0"),
    ("prompt-missing", COMPLETIONS, b'{"max_tokens": 3}', 400, "prompt", "missing_required_parameter", "prompt"),
    ("messages-missing", CHAT, b'{"model": "tiny-llama"}', 400, "messages", "missing_required_parameter", "messages"),
    ("messages-empty", CHAT, _chat(messages=[]), 400, "messages", "invalid_value", "at least 1"),
    ("tool-role", CHAT, _chat(messages=[{"role": "tool", "content": "x"}]), 400, "messages.0.role", "invalid_type", "'user'"),
    ("content-number", CHAT, _chat(messages=[{"role": "user", "content": 5}]), 400, "messages.0.content", "invalid_type", "list of text parts"),
    ("image-part", CHAT, _chat(messages=[ {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]} ] ), 400, "messages.0.content", "invalid_type", "text parts"),
    ("tool-calls-field", CHAT, _chat(messages=[{"role": "assistant", "content": "", "tool_calls": []}]), 400, "messages.0", "invalid_value", "tool calls"),
    ("unknown-field", COMPLETIONS, _c(frobnicate=1), 400, "frobnicate", "unknown_parameter", "Unrecognized request argument supplied: frobnicate"),
    ("n-2", CHAT, _chat(n=2), 400, "n", "unsupported_value", "only n=1"),
    ("best-of", COMPLETIONS, _c(best_of=3), 400, "best_of", "unsupported_value", "best_of=1"),
    ("echo", COMPLETIONS, _c(echo=True), 400, "echo", "unsupported_parameter", "echo"),
    ("suffix", COMPLETIONS, _c(suffix="end"), 400, "suffix", "unsupported_parameter", "suffix"),
    ("penalty", CHAT, _chat(presence_penalty=0.5), 400, "presence_penalty", "unsupported_parameter", "not supported"),
    ("logit-bias", COMPLETIONS, _c(logit_bias={"5": 1.0}), 400, "logit_bias", "unsupported_parameter", "logit_bias"),
    ("tools", CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools", "unsupported_parameter", "tools"),
    ("json-mode", CHAT, _chat(response_format={"type": "json_object"}), 400, "response_format", "unsupported_parameter", "json_object"),
    ("stream-options-alone", COMPLETIONS, _c(stream_options={"include_usage": True}), 400, "stream_options", "invalid_value", "only allowed when stream is true"),
    ("top-logprobs-alone", CHAT, _chat(top_logprobs=2), 400, "top_logprobs", "invalid_value", "needs logprobs"),
    ("negative-temperature", COMPLETIONS, _c(temperature=-1), 400, "temperature", "invalid_value", ">= 0"),
    ("top-p-zero", CHAT, _chat(top_p=0), 400, "top_p", "invalid_value", "(0, 1]"),
    ("top-k-negative", COMPLETIONS, _c(top_k=-2), 400, "top_k", "invalid_value", "top_k"),
    ("max-tokens-zero", COMPLETIONS, _c(max_tokens=0), 400, "max_tokens", "invalid_value", ">= 1"),
    ("max-completion-tokens-negative", CHAT, _chat(max_completion_tokens=-5), 400, "max_completion_tokens", "invalid_value", ">= 1"),
    ("top-logprobs-too-many", CHAT, _chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", "invalid_value", "[0, 20]"),
    ("max-completion-tokens-too-many", CHAT, _chat(max_completion_tokens=300), 400, "max_completion_tokens", "context_length_exceeded", "Please reduce"),
    ("logprobs-too-many", COMPLETIONS, _c(logprobs=50), 400, "logprobs", "invalid_value", "[0, 20]"),
    ("stop-token-negative", COMPLETIONS, _c(stop_token_ids=[-1]), 400, "stop_token_ids", "invalid_value", ">= 0"),
    ("too-many-stops", COMPLETIONS, _c(stop=[f"s{i}" for i in range(17)]), 400, "stop", "invalid_value", "at most 16"),
    ("empty-stop", COMPLETIONS, _c(stop=[""]), 400, "stop", "invalid_value", "non-empty"),
    ("prompt-empty", COMPLETIONS, _c(prompt=""), 400, "prompt", "invalid_value", "prompt is empty"),
    ("prompt-list-empty", COMPLETIONS, _c(prompt=[]), 400, "prompt", "invalid_value", "prompt is empty"),
    ("too-many-prompts", COMPLETIONS, _c(prompt=["a"] * 33), 400, "prompt", "invalid_value", "at most 32 prompts"),
    ("token-outside-vocab", COMPLETIONS, _c(prompt=[1, 99999]), 400, "prompt", "invalid_value", "outside the vocabulary"),
    ("prompt-too-long", COMPLETIONS, _c(prompt=LONG), 400, "prompt", "context_length_exceeded", "maximum context length is 256 tokens"),
    ("prompt-plus-max-tokens", COMPLETIONS, _c(max_tokens=255), 400, "max_tokens", "context_length_exceeded", "Please reduce the prompt or max_tokens"),
    ("conversation-too-long", CHAT, _chat(messages=[{"role": "user", "content": LONG}]), 400, "messages", "context_length_exceeded", "your conversation has"),
    ("unknown-model", CHAT, _chat(model="gpt-4o"), 404, "model", "model_not_found", "'gpt-4o' does not exist"),
]
# fmt: on


@pytest.mark.parametrize(
    ("path", "raw", "status", "param", "code", "words"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_bad_input(
    stack: Stack, path: str, raw: bytes, status: int, param: str | None, code: str, words: str
) -> None:
    r = stack.client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert (err["param"], err["code"]) == (param, code), err
    assert words in err["message"], err["message"]


def test_streaming_request_errors_before_the_stream(stack: Stack) -> None:
    """A bad streaming request is a plain 4xx JSON answer, not an event stream."""
    r = stack.client.post(CHAT, json={"messages": USER, "stream": True, "temperature": -3})
    assert r.status_code == 400
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["param"] == "temperature"


def test_unknown_route_and_method(stack: Stack) -> None:
    missing = stack.client.post("/v1/embeddings", json={})
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "no such endpoint: POST /v1/embeddings"
    wrong = stack.client.get(COMPLETIONS)
    assert wrong.status_code == 405
    assert wrong.json()["error"]["code"] == "method_not_allowed"


def test_the_server_stays_up_and_nothing_leaks(stack: Stack) -> None:
    for _, path, raw, *_ in CASES:
        stack.client.post(path, content=raw)
    assert stack.client.get("/health").json() == {"status": "ok"}
    ok = stack.client.post(COMPLETIONS, json={"model": MODEL, "prompt": "hello", "max_tokens": 3})
    assert ok.status_code == 200
    stats = stack.wait_idle()
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert stack.server.state.in_flight == 0


def test_accepted_compatibility_fields(stack: Stack) -> None:
    """Fields OpenAI clients send that do not change generation are accepted."""
    extra = {
        "user": "u1",
        "metadata": {"k": "v"},
        "store": False,
        "n": 1,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "parallel_tool_calls": False,
        "max_tokens": 2,
    }
    r = stack.client.post(CHAT, json={"messages": USER, **extra})
    assert r.status_code == 200, r.text
