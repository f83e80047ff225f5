"""The OpenAI-compatible server over a real ``AsyncLLMEngine`` on a tiny model, through HTTP.

``Stack`` (engine + app + uvicorn on a free port) is reused by the other
``test_server_*`` modules.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from kvtier.engine import LLM, AsyncLLMEngine, EngineConfig, SamplingParams
from kvtier.engine.connector import KVConnector
from kvtier.engine.metrics import EngineMetrics
from kvtier.engine.server import BackgroundServer, ServerLimits, create_app
from tests.engine.tiny_models import write_tiny_model

MODEL = "tiny-llama"
ENGINE = dict(
    dtype="float32",
    device="cpu",
    block_size=16,
    num_kv_blocks=64,
    max_model_len=256,
    max_num_seqs=8,
    num_threads=1,
)


@dataclass
class Stack:
    """A started engine served over HTTP on 127.0.0.1."""

    engine: AsyncLLMEngine
    server: BackgroundServer
    client: httpx.Client

    @property
    def url(self) -> str:
        return self.server.url

    def close(self) -> None:
        self.client.close()
        self.server.close()
        self.engine.shutdown()

    def wait_idle(self, timeout_s: float = 20.0) -> Any:
        """Engine stats once nothing runs or waits and no KV block is in use (bounded)."""
        deadline = time.monotonic() + timeout_s
        while True:
            s = self.engine.stats()
            idle = s.num_running == 0 and s.num_waiting == 0 and s.kv_blocks_used == 0
            if idle or time.monotonic() > deadline:
                return s
            time.sleep(0.05)


def start_stack(
    model_dir: Path,
    *,
    connector: KVConnector | None = None,
    limits: ServerLimits | None = None,
    graceful_timeout_s: float = 5.0,
    served_model_name: str = MODEL,
    **overrides: Any,
) -> Stack:
    registry = CollectorRegistry()
    config = EngineConfig(model=str(model_dir), **{**ENGINE, **overrides})
    engine = AsyncLLMEngine(config, EngineMetrics(registry), connector)
    engine.start()
    app = create_app(
        engine, served_model_name=served_model_name, registries=[registry], limits=limits
    )
    server = BackgroundServer(app, graceful_timeout_s=graceful_timeout_s).start()
    return Stack(engine, server, httpx.Client(base_url=server.url, timeout=60.0))


def sse_events(lines: Iterator[str]) -> list[Any]:
    """Parses ``data:`` lines; the last item is the string ``"[DONE]"``."""
    events: list[Any] = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def stream(client: httpx.Client, path: str, body: dict[str, Any]) -> list[Any]:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = write_tiny_model(tmp_path_factory.mktemp("server") / "tiny", "llama", seed=5)
    return path


@pytest.fixture(scope="module")
def stack(tiny: Path) -> Iterator[Stack]:
    s = start_stack(tiny)
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(tiny: Path) -> LLM:
    return LLM(str(tiny), **ENGINE)


GREEDY = {"temperature": 0, "ignore_eos": True}


def test_completion_matches_the_engine(stack: Stack, reference: LLM) -> None:
    prompt = "Paged attention stores keys"
    expected = reference.generate(
        prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )[0]
    r = stack.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 10, **GREEDY}
    )
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == MODEL and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice == {
        "index": 0,
        "text": expected.text,
        "logprobs": None,
        "finish_reason": "length",
    }
    assert body["usage"] == {
        "prompt_tokens": len(expected.prompt_token_ids),
        "completion_tokens": 10,
        "total_tokens": len(expected.prompt_token_ids) + 10,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_default_max_tokens_is_16(stack: Stack) -> None:
    r = stack.client.post("/v1/completions", json={"prompt": "The quick", **GREEDY})
    assert r.json()["usage"]["completion_tokens"] == 16


def test_streamed_completion_equals_the_whole_one(stack: Stack) -> None:
    body = {"prompt": "The quick brown fox jumps", "max_tokens": 12, **GREEDY}
    whole = stack.client.post("/v1/completions", json=body).json()
    events = stream(stack.client, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert all(c["usage"] is None for c in chunks)  # no include_usage


def test_prompt_forms_and_several_prompts(stack: Stack) -> None:
    tok = stack.engine.tokenizer
    ids = tok.encode("Héllo wörld")
    as_text = stack.client.post(
        "/v1/completions", json={"prompt": "Héllo wörld", "max_tokens": 6, **GREEDY}
    )
    as_ids = stack.client.post("/v1/completions", json={"prompt": ids, "max_tokens": 6, **GREEDY})
    assert as_text.json()["choices"] == as_ids.json()["choices"]
    prompts = ["def forward(self, x):", "The quick brown"]
    many = stack.client.post(
        "/v1/completions", json={"prompt": prompts, "max_tokens": 6, **GREEDY}
    ).json()
    singles = [
        stack.client.post("/v1/completions", json={"prompt": p, "max_tokens": 6, **GREEDY}).json()
        for p in prompts
    ]
    assert [c["index"] for c in many["choices"]] == [0, 1]
    assert [c["text"] for c in many["choices"]] == [s["choices"][0]["text"] for s in singles]
    assert many["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    events = stream(stack.client, "/v1/completions", {"prompt": prompts, "max_tokens": 6, **GREEDY})
    texts = ["", ""]
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == [c["text"] for c in many["choices"]]
    token_lists = stack.client.post(
        "/v1/completions", json={"prompt": [ids, ids[:3]], "max_tokens": 2, **GREEDY}
    )
    assert len(token_lists.json()["choices"]) == 2


def test_chat_matches_the_engine_and_streams_the_same(stack: Stack, reference: LLM) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is a KV cache?"},
    ]
    expected = reference.chat(
        messages, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    )[0]
    body = {"model": MODEL, "messages": messages, "max_tokens": 9, **GREEDY}
    whole = stack.client.post("/v1/chat/completions", json=body).json()
    assert whole["object"] == "chat.completion" and whole["id"].startswith("chatcmpl-")
    (choice,) = whole["choices"]
    assert choice["message"] == {"role": "assistant", "content": expected.text}
    assert choice["finish_reason"] == "length"
    assert whole["usage"]["prompt_tokens"] == expected.num_prompt_tokens
    assert whole["usage"]["completion_tokens"] == 9

    events = stream(
        stack.client, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}
    )
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c for c in chunks if c["choices"]]
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == expected.text
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (expected.num_prompt_tokens, 9)
    assert usage["total_tokens"] == expected.num_prompt_tokens + 9


def test_message_content_parts_and_developer_role(stack: Stack) -> None:
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    parts = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
        },
    ]
    a = stack.client.post(
        "/v1/chat/completions", json={"messages": plain, "max_tokens": 5, **GREEDY}
    )
    b = stack.client.post(
        "/v1/chat/completions", json={"messages": parts, "max_tokens": 5, **GREEDY}
    )
    assert a.json()["choices"] == b.json()["choices"]


def test_cached_tokens_count_prefix_cache_hits(stack: Stack) -> None:
    prompt = "Paged attention stores keys and values in fixed-size blocks. " * 3
    body = {"prompt": prompt, "max_tokens": 2, **GREEDY}
    first = stack.client.post("/v1/completions", json=body).json()["usage"]
    second = stack.client.post("/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens"] == second["prompt_tokens"] > 32
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["prompt_tokens_details"]["cached_tokens"]
    # whole 16-token blocks, and at least one prompt token is always computed
    assert cached > 0 and cached % 16 == 0
    assert cached == (second["prompt_tokens"] - 1) // 16 * 16


def test_stop_strings_and_finish_reason(stack: Stack) -> None:
    base = {"prompt": "The quick brown fox", "max_tokens": 12, **GREEDY}
    text = stack.client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    stop = text[4:7]
    assert stop and stop in text
    stopped = stack.client.post("/v1/completions", json={**base, "stop": stop}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == text[: text.index(stop)]
    events = stream(stack.client, "/v1/completions", {**base, "stop": [stop]})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == stopped["text"]


def test_seeded_sampling_is_reproducible(stack: Stack) -> None:
    body = {
        "prompt": "Numbers 12345",
        "max_tokens": 12,
        "temperature": 1.0,
        "top_k": 30,
        "top_p": 0.9,
    }
    a = stack.client.post("/v1/completions", json={**body, "seed": 11}).json()["choices"][0]["text"]
    b = stack.client.post("/v1/completions", json={**body, "seed": 11}).json()["choices"][0]["text"]
    assert a == b


def test_completion_logprobs(stack: Stack) -> None:
    body = {"prompt": "The lazy dog", "max_tokens": 5, "logprobs": 3, **GREEDY}
    choice = stack.client.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"][0] == 0
    assert lp["text_offset"] == sorted(lp["text_offset"])
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely token
    events = stream(stack.client, "/v1/completions", body)
    streamed = [
        t
        for e in events[:-1]
        if e["choices"][0]["logprobs"]
        for t in e["choices"][0]["logprobs"]["tokens"]
    ]
    assert streamed == lp["tokens"]


def test_chat_logprobs(stack: Stack) -> None:
    body = {
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "logprobs": True,
        "top_logprobs": 2,
        **GREEDY,
    }
    choice = stack.client.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 2
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"])
        assert bytes(entry["bytes"]) == bytes(entry["top_logprobs"][0]["bytes"])
    no_lp = stack.client.post(
        "/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": None}
    )
    assert no_lp.json()["choices"][0]["logprobs"] is None


def test_models_health_and_metrics(stack: Stack) -> None:
    models = stack.client.get("/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["root"] == "tiny"
    assert card["max_model_len"] == 256
    assert stack.client.get("/health").json() == {"status": "ok"}
    stack.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    metrics = stack.client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert "kvtier_engine_time_to_first_token_seconds_bucket" in text
    assert "kvtier_engine_kv_blocks_total 64.0" in text
    assert 'kvtier_engine_http_requests_total{endpoint="/v1/completions",status="2xx"}' in text
    # the served model's name is also accepted under the engine's own model id
    assert (
        stack.client.post(
            "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}
        ).status_code
        == 200
    )


def test_kvtier_connector_hits_and_metrics(tiny: Path) -> None:
    """cached_tokens counts tokens loaded by the KV connector; /metrics shows its registry."""
    from kvtier.config import KvtierConfig
    from kvtier.connectors.kvtier_connector import KvtierConnector

    connector = KvtierConnector(
        config=KvtierConfig(
            chunk_size=32,
            tiers=[{"type": "cpu", "capacity": "64MiB"}],
            connector={"min_load_tokens": 16},
        )
    )
    # no engine prefix cache: every hit below comes from the connector
    s = start_stack(tiny, connector=connector, enable_prefix_caching=False)
    try:
        body = {
            "prompt": "Paged attention stores keys and values in blocks. " * 4,
            "max_tokens": 2,
            **GREEDY,
        }
        first = s.client.post("/v1/completions", json=body).json()
        assert connector.flush(timeout=20.0)
        second = s.client.post("/v1/completions", json=body).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        prompt_tokens = second["usage"]["prompt_tokens"]
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == prompt_tokens - 1 > 0  # the same prompt again: all but its last token
        assert second["choices"] == first["choices"]  # loaded KV gives the same greedy text
        text = s.client.get("/metrics").text
        assert "kvtier_engine_time_to_first_token_seconds" in text
        assert 'kvtier_load_tokens_total{outcome="loaded"}' in text
    finally:
        s.close()
