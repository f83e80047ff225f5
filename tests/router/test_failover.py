"""A stream that survives its engine: two real ``kvtier engine serve`` processes on a shared
tier behind the router; the engine serving a stream is killed (SIGKILL) or stopped
(SIGSTOP) mid-stream, and the client still gets one complete stream whose greedy text
equals an uninterrupted run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvtier.engine.models.loader import load_tokenizer
from kvtier.router.app import BackgroundRouter, create_router_app
from kvtier.router.config import EngineSpec, RouterConfig
from tests.server.helpers import running_server

pytestmark = pytest.mark.slow
CHUNK = 32
MAX_TOKENS = 360
AFTER = 60  # events the client reads before the engine is interrupted


@dataclass
class EngineProc:
    url: str
    proc: subprocess.Popen[bytes]


@contextmanager
def engine_process(model: Path, config: Path, log: Path) -> Iterator[EngineProc]:
    """A ``kvtier engine serve`` process on a free port (terminated, or killed, at the end)."""
    cmd = [
        sys.executable, "-m", "kvtier.cli", "engine", "serve", "-m", str(model), "--port", "0",
        "--served-model-name", "tiny", "--dtype", "float32", "--device", "cpu",
        "--kv-cache-memory", "8MiB", "--threads", "1",
        "--kv-connector", "kvtier", "--kvtier-config", str(config),
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        url = None
        deadline = time.monotonic() + 180
        while url is None:
            assert proc.poll() is None, f"engine exited: {log.read_text()}"
            assert time.monotonic() < deadline, f"engine did not start: {log.read_text()}"
            for line in log.read_text().splitlines():
                if " on http://" in line:
                    url = line.split(" on ", 1)[1].split()[0]
            time.sleep(0.1)
        yield EngineProc(url, proc)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)  # a stopped engine cannot exit
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def fleet(tiny_model: Path, tmp_path: Path) -> Iterator[list[EngineProc]]:
    """Two engines on one shared tier (a ``kvtier serve`` cache server)."""
    with running_server() as cache, ExitStack() as stack:
        config = tmp_path / "kvtier.yaml"
        data = {
            "chunk_size": CHUNK,
            "tiers": [{"type": "remote", "address": cache.address}],
            "connector": {"min_load_tokens": 16, "verify_fraction": 0, "save_decode": True},
        }
        config.write_text(yaml.safe_dump(data))
        yield [
            stack.enter_context(engine_process(tiny_model, config, tmp_path / f"e{i}.log"))
            for i in range(2)
        ]


@dataclass
class StreamResult:
    engine: str
    text: str
    finish_reasons: list[str]
    ids: set[str]
    errors: list[Any]
    usage: dict[str, Any] | None
    events: int


def stream(router: str, path: str, body: dict[str, Any], on_event: Any = None) -> StreamResult:
    """One streamed request through the router; ``on_event(n, engine)`` after event n."""
    text, reasons, ids, errors, usage, n = "", [], set(), [], None, 0
    with httpx.stream("POST", router + path, json=body, timeout=300, trust_env=False) as r:
        assert r.status_code == 200, r.read()
        engine = r.headers["x-kvtier-engine"]
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                break
            event = json.loads(payload)
            n += 1
            if "error" in event:
                errors.append(event["error"])
                continue
            ids.add(event["id"])
            assert "token_ids" not in json.dumps(event), "ids the client did not ask for"
            if event.get("usage") and not event["choices"]:
                usage = event["usage"]
            for c in event["choices"]:
                piece = c["delta"].get("content") if "delta" in c else c["text"]
                text += piece or ""
                if c.get("finish_reason"):
                    reasons.append(c["finish_reason"])
            if on_event is not None:
                on_event(n, engine)
    return StreamResult(engine, text, reasons, ids, errors, usage, n)


def failover_counts(router: str) -> dict[str, int]:
    r = httpx.get(router + "/failover", timeout=30, trust_env=False)
    assert r.status_code == 200
    counts: dict[str, int] = r.json()
    return counts


BODIES = {
    "/v1/completions": {
        "model": "tiny",
        "prompt": "A stream survives its engine when the router continues it. " * 2,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    },
    "/v1/chat/completions": {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Continue this on another engine, please. " * 2}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    },
}


def _interrupt(
    fleet: list[EngineProc], how: signal.Signals, after: int
) -> tuple[Any, list[EngineProc]]:
    hit: list[EngineProc] = []

    def on_event(n: int, engine: str) -> None:
        if n == after and not hit:
            victim = next(e for e in fleet if e.url == engine)
            os.kill(victim.proc.pid, how)
            hit.append(victim)

    return on_event, hit


BODIES["/v1/chat/completions#no-limit"] = {
    k: v for k, v in BODIES["/v1/chat/completions"].items() if k != "max_tokens"
}  # the reply may run to the end of the context: the router asks the engine for its length


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stalled"])
def test_an_engine_lost_mid_stream_leaves_one_complete_stream_with_the_same_greedy_text(
    fleet: list[EngineProc], tiny_model: Path, path: str, how: signal.Signals
) -> None:
    tokenizer = load_tokenizer(tiny_model)
    rc = RouterConfig(
        engines=tuple(EngineSpec(e.url) for e in fleet),
        policy="round_robin",
        health_interval_s=0.2,
        health_timeout_s=0.5,
        stall_timeout_s=1.0,
    )
    body = BODIES[path]
    path = path.split("#")[0]
    with BackgroundRouter(create_router_app(rc, tokenizer)) as router:
        whole = stream(router.url, path, body)
        assert not whole.errors and whole.finish_reasons == ["length"]
        assert whole.usage is not None
        generated = whole.usage["completion_tokens"]
        assert generated == body.get("max_tokens", 512 - whole.usage["prompt_tokens"])
        assert failover_counts(router.url)["streams_interrupted"] == 0

        on_event, hit = _interrupt(fleet, how, after=AFTER)
        survived = stream(router.url, path, body, on_event)
        assert hit, "the stream ended before its engine could be interrupted"
        counts = failover_counts(router.url)
        assert counts["streams_interrupted"] == 1, counts
        assert counts["streams_completed"] == 1, counts
        assert counts["failed_requests"] == 0, counts
        assert not survived.errors
        assert len(survived.ids) == 1, "one stream id throughout"
        assert survived.finish_reasons == ["length"]
        assert survived.text == whole.text  # no character duplicated, none missing
        assert survived.usage is not None
        assert survived.usage["completion_tokens"] == generated
        assert survived.usage["prompt_tokens"] == whole.usage["prompt_tokens"]
        # the second engine loaded the prompt and the first engine's decode-time saves: it
        # computed less than one chunk (the tail after the last saved chunk)
        assert counts["tokens_loaded_from_tier"] + counts["tokens_from_g1"] >= 3 * CHUNK, counts
        assert counts["tokens_recomputed"] < CHUNK, counts
        metrics = httpx.get(router.url + "/metrics", timeout=30, trust_env=False).text
        assert "kvtier_router_failover_streams_completed_total 1.0" in metrics
