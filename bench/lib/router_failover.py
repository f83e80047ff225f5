"""The failover phase of ``bench/serve_router.py``: an engine killed mid-stream under load.

Two engines with the kvtier connector on one shared tier behind ``kvtier
router`` (stream failover on: its default). Streamed greedy requests (each
a document of its own, a long answer) arrive at ``qps``; once at least
``min_streams`` of them are mid-stream on one engine (their first content
chunk received, ``x-kvtier-engine`` naming it), that engine's process group
is killed (SIGKILL, by PID). Every request then runs to its end.

Counted: from the client, requests that ended with an error (an HTTP
error, an ``error`` event, a stream without ``[DONE]``) and the streams that
were mid-stream on the killed engine; from the router (``GET /failover``,
docs/router.md), ``streams_interrupted``, ``streams_completed``,
``failed_requests`` and the prompt tokens of the continuations loaded from
the tier or recomputed. Each interrupted stream's text is then compared
with the surviving engine's answer to the same request (greedy, not
streamed): ``texts_equal`` of ``texts_compared``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvtier.bench.lib.router_fleet import EngineProcess
from kvtier.bench.lib.serve_workloads import TextMaker, poisson_arrivals

ENGINE_HEADER = "x-kvtier-engine"
FAILOVER_COUNTERS = (
    "streams_interrupted",
    "streams_completed",
    "failed_requests",
    "tokens_loaded_from_tier",
    "tokens_recomputed",
)


@dataclass
class Stream:
    """One streamed request as the client saw it."""

    index: int
    messages: list[dict[str, str]]
    engine: str | None = None
    chunks: int = 0
    text: str = ""
    done: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float = 0.0
    chunks_at_kill: int | None = None  # content chunks received when its engine was killed


@dataclass(frozen=True)
class FailoverLoad:
    """The requests of the phase."""

    requests: int = 8
    prompt_tokens: int = 700
    answer_tokens: int = 96
    qps: float = 1.0
    min_streams: int = 2
    seed: int = 0


@dataclass
class _Run:
    streams: list[Stream] = field(default_factory=list)
    killed: str | None = None
    killed_at_s: float | None = None


def _payload(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


async def stream_request(
    client: httpx.AsyncClient, url: str, s: Stream, model: str, max_tokens: int
) -> None:
    """Sends ``s`` (a streamed greedy chat completion) to ``url``; fills in what came back."""
    sent = time.perf_counter()
    try:
        async with client.stream(
            "POST", url + "/v1/chat/completions", json=_payload(model, s.messages, max_tokens)
        ) as resp:
            s.engine = resp.headers.get(ENGINE_HEADER)
            if resp.status_code != 200:
                s.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    s.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    s.error = f"error event: {event['error']}"
                    return
                for choice in event.get("choices", []):
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        if s.ttft_s is None:
                            s.ttft_s = time.perf_counter() - sent
                        s.chunks += 1
                        s.text += piece
        if not s.done and s.error is None:
            s.error = "the stream ended without [DONE]"
    except (httpx.HTTPError, ValueError) as e:
        s.error = f"{type(e).__name__}: {e}"
    finally:
        s.e2e_s = time.perf_counter() - sent


async def _killer(
    run: _Run,
    engines: dict[str, EngineProcess],
    min_streams: int,
    deadline_s: float,
    t0: float,
) -> None:
    """Kills the engine with the most streams mid-stream, once it has ``min_streams`` of them."""
    while run.killed is None:
        mid: dict[str, list[Stream]] = {}
        for s in run.streams:
            if s.engine in engines and s.chunks > 0 and not s.done and s.error is None:
                mid.setdefault(s.engine, []).append(s)
        late = time.perf_counter() - t0 > deadline_s
        if mid:
            url, streams = max(mid.items(), key=lambda kv: len(kv[1]))
            if len(streams) >= min_streams or late:
                for s in streams:
                    s.chunks_at_kill = s.chunks
                engines[url].kill()
                run.killed, run.killed_at_s = url, time.perf_counter() - t0
                return
        await asyncio.sleep(0.05)


async def _drive(
    router_url: str,
    engines: dict[str, EngineProcess],
    load: FailoverLoad,
    messages: list[list[dict[str, str]]],
    model: str,
    timeout_s: float,
) -> _Run:
    run = _Run([Stream(i, m) for i, m in enumerate(messages)])
    arrivals = poisson_arrivals(load.qps, load.requests, random.Random(f"{load.seed}:failover"))
    t0 = time.perf_counter()
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:

        async def one(s: Stream, at: float) -> None:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            await stream_request(client, router_url, s, model, load.answer_tokens)

        killer = asyncio.create_task(
            _killer(run, engines, load.min_streams, arrivals[-1] + 30.0, t0)
        )
        await asyncio.gather(*(one(s, at) for s, at in zip(run.streams, arrivals, strict=True)))
        if not killer.done():
            killer.cancel()  # every stream ended before any was mid-stream long enough
    return run


def _reference(url: str, messages: list[dict[str, str]], model: str, max_tokens: int) -> str:
    body = _payload(model, messages, max_tokens)
    body["stream"] = False
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300.0, trust_env=False)
    r.raise_for_status()
    return str(r.json()["choices"][0]["message"]["content"])


def failover_messages(
    count: Callable[[str], int], load: FailoverLoad
) -> list[list[dict[str, str]]]:
    maker = TextMaker(count)
    rng = random.Random(f"{load.seed}:failover-docs")
    out = []
    for _ in range(load.requests):
        doc = maker.text(load.prompt_tokens, rng)
        out.append([{"role": "user", "content": f"{doc}\n\nContinue the text above."}])
    return out


def run_failover(
    router_url: str,
    engines: list[EngineProcess],
    load: FailoverLoad,
    count: Callable[[str], int],
    *,
    model: str = "smollm2",
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Runs the phase through ``router_url``; kills one of ``engines``. Returns its figures."""
    by_url = {e.url: e for e in engines}
    messages = failover_messages(count, load)
    run = asyncio.run(_drive(router_url, by_url, load, messages, model, timeout_s))
    time.sleep(1.0)
    counters: dict[str, Any] = {}
    try:
        r = httpx.get(router_url + "/failover", timeout=30.0, trust_env=False)
        if r.status_code == 200:
            counters = r.json()
    except (httpx.HTTPError, ValueError):
        counters = {}
    hit = [s for s in run.streams if s.chunks_at_kill is not None]
    survivor = next((e.url for e in engines if e.url != run.killed), None)
    compared = equal = 0
    diffs = []
    if survivor is not None:
        for s in hit:
            if s.error is None:
                compared += 1
                ref = _reference(survivor, s.messages, model, load.answer_tokens)
                equal += int(ref == s.text)
                same = next(
                    (i for i, (x, y) in enumerate(zip(ref, s.text, strict=False)) if x != y),
                    min(len(ref), len(s.text)),
                )
                diffs.append(
                    {"chars": len(s.text), "reference_chars": len(ref), "same_chars": same,
                     "chunks_before_kill": s.chunks_at_kill,
                     "text_at": s.text[max(0, same - 20) : same + 40],
                     "reference_at": ref[max(0, same - 20) : same + 40]}
                )  # fmt: skip
    client_failed = sum(1 for s in run.streams if s.error is not None)
    out: dict[str, Any] = {k: counters.get(k) for k in FAILOVER_COUNTERS}
    # NOTE: the client's count of failed requests is the one the bar reads: it also sees
    # a failure the router did not count (a stream cut without an error event)
    out["failed_requests"] = max(client_failed, int(counters.get("failed_requests") or 0))
    out.update(
        requests=len(run.streams),
        killed_engine=run.killed,
        killed_at_s=run.killed_at_s,
        streams_mid_stream_at_kill=len(hit),
        chunks_before_kill=[s.chunks_at_kill for s in hit],
        client_errors=[s.error for s in run.streams if s.error is not None],
        texts_compared=compared,
        texts_equal=equal,
        # where each interrupted stream's text first differs from the reference
        text_diffs=diffs,
        router_counters=counters,
        workload=vars(load),
    )
    return out
