"""The warm-start phase of ``bench/serve_router.py``: a fresh replica joins, warmed or cold.

One engine (the fleet) with the kvtier connector on a ``kvtier serve`` cache
server, behind ``kvtier router --policy cache_aware``. **Priming**: questions
about a few hot documents (each a shared prefix), so the fleet's G1, the
shared tier and the router's hit statistics know them. Then, twice:

1. a fresh engine (the same build, connector on the same tier) is started
   and joins through ``POST /engines`` — ``"warm": false`` the first time,
   ``"warm": true`` the second (then the phase waits until ``GET
   /warm_start`` says it is no longer warming: it takes no traffic before);
2. it **replaces** the engine before it: that one is killed while idle and
   the phase waits until the router has taken it out, so the new replica
   takes all the traffic (a rolling replacement; with the old engine still
   in, the router would keep the hot prefixes where they are, and it cannot
   score a vLLM replica that joined at runtime: its KV events are given at
   start, ``--vllm-kv-events``);
3. for ``window_s`` (a minute) new questions about the same documents
   arrive at ``qps``; **TTFT of the requests the new replica answered**
   (``x-kvtier-engine``): its first minute.

Each pass asks its own questions (another seed), so the second does not
find the first one's prompts in the tier. A cold replica loads each hot
document from the tier at its first request for it, and its first requests
pay what a fresh process pays once (its first forward passes); a warmed one
did both during warm-up, before it took traffic.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvtier.bench.lib.router_failover import Stream, stream_request
from kvtier.bench.lib.router_fleet import (
    FleetOptions,
    RouterProcess,
    engine_process,
    shared_tier,
)
from kvtier.bench.lib.serve_metrics import run_metrics, scrape
from kvtier.bench.lib.serve_stats import percentile
from kvtier.bench.lib.serve_workloads import TextMaker, poisson_arrivals


@dataclass(frozen=True)
class WarmLoad:
    """Hot documents, the priming and the measured window."""

    documents: int = 4
    document_tokens: int = 1200
    question_tokens: int = 24
    answer_tokens: int = 16
    prime_requests: int = 16
    qps: float = 2.0
    window_s: float = 60.0
    seed: int = 0


def _questions(
    maker: TextMaker, docs: list[str], n: int, tokens: int, rng: random.Random
) -> list[list[dict[str, str]]]:
    out = []
    for _ in range(n):
        doc = docs[rng.randrange(len(docs))]
        question = maker.text(tokens, rng)
        out.append([{"role": "system", "content": doc}, {"role": "user", "content": question}])
    return out


async def _send_all(
    url: str,
    messages: list[list[dict[str, str]]],
    arrivals: list[float],
    max_tokens: int,
    timeout_s: float,
) -> list[Stream]:
    streams = [Stream(i, m) for i, m in enumerate(messages)]
    t0 = time.perf_counter()
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:

        async def one(s: Stream, at: float) -> None:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            await stream_request(client, url, s, "smollm2", max_tokens)

        await asyncio.gather(*(one(s, at) for s, at in zip(streams, arrivals, strict=True)))
    return streams


def _join(router_url: str, engine_url: str, warm: bool, deadline_s: float) -> dict[str, Any]:
    """Adds the engine to the router; with ``warm``, waits until it takes traffic."""
    r = httpx.post(
        router_url + "/engines", json={"url": engine_url, "warm": warm}, timeout=30.0,
        trust_env=False,
    )  # fmt: skip
    if r.status_code != 201:
        raise RuntimeError(f"POST /engines answered {r.status_code}: {r.text[:300]}")
    t0 = time.monotonic()
    state: dict[str, Any] = {}
    while warm and time.monotonic() - t0 < deadline_s:
        snap = httpx.get(router_url + "/warm_start", timeout=30.0, trust_env=False).json()
        state = snap.get("engines", {}).get(engine_url, {})
        if state.get("state") not in (None, "waiting", "warming"):
            break
        time.sleep(0.5)
    state["wait_s"] = time.monotonic() - t0
    return state


def _wait_out(router_url: str, engine_url: str, timeout_s: float) -> None:
    """Waits until the router's health checks have taken ``engine_url`` out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = httpx.get(router_url + "/health", timeout=10.0, trust_env=False).json()
        if not health.get("engines", {}).get(engine_url, {}).get("healthy", False):
            return
        time.sleep(0.2)
    raise RuntimeError(f"the router still routes to {engine_url} {timeout_s:g} s after it died")


def run_warm_start(
    opts: FleetOptions,
    workdir: Path,
    load: WarmLoad,
    count: Callable[[str], int],
    args: argparse.Namespace,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """Runs the phase; returns ``{"with": {...}, "without": {...}, ...}``."""
    workdir.mkdir(parents=True, exist_ok=True)
    maker = TextMaker(count)
    rng = random.Random(f"{load.seed}:warm-docs")
    docs = [maker.text(load.document_tokens, rng) for _ in range(load.documents)]
    out: dict[str, Any] = {"workload": vars(load)}
    with ExitStack() as stack:
        config = stack.enter_context(shared_tier(workdir))
        fleet = stack.enter_context(
            engine_process(opts, workdir, "fleet0", args.fleet_kv_tokens, connector=config)
        )
        router = stack.enter_context(
            RouterProcess([(fleet, "both")], "cache_aware", workdir / "router.log")
        )
        say(f"warm start: fleet engine up at {fleet.url}; priming {load.prime_requests} requests")
        prime = _questions(maker, docs, load.prime_requests, load.question_tokens, rng)
        arrivals = poisson_arrivals(load.qps, len(prime), random.Random(f"{load.seed}:prime"))
        primed = asyncio.run(
            _send_all(router.url, prime, arrivals, load.answer_tokens, args.request_timeout_s)
        )
        out["prime_errors"] = sum(1 for s in primed if s.error is not None)
        previous = fleet
        for variant, warm in (("without", False), ("with", True)):
            joiner = stack.enter_context(
                engine_process(
                    opts, workdir, f"joiner-{variant}", args.fleet_kv_tokens, connector=config
                )
            )
            state = _join(router.url, joiner.url, warm, 120.0)
            say(f"  {variant} warm-up: {joiner.url} joined ({state.get('state', 'cold')})")
            # it replaces the engine before it (killed while idle), so it takes all the traffic
            previous.kill()
            _wait_out(router.url, previous.url, 30.0)
            n = max(1, round(load.qps * load.window_s))
            qrng = random.Random(f"{load.seed}:warm-{variant}")
            msgs = _questions(maker, docs, n, load.question_tokens, qrng)
            at = poisson_arrivals(load.qps, n, random.Random(f"{load.seed}:at-{variant}"))
            at = [t for t in at if t < load.window_s] or at[:1]
            streams = asyncio.run(
                _send_all(router.url, msgs[: len(at)], at, load.answer_tokens,
                          args.request_timeout_s)
            )  # fmt: skip
            mine = [s for s in streams if s.engine == joiner.url and s.ttft_s is not None]
            ttft = [s.ttft_s for s in mine if s.ttft_s is not None]
            out[variant] = {
                "requests": len(mine),
                "ttft_s": ttft,  # in arrival order
                "joiner_counters": run_metrics(scrape(joiner.url) or {}),  # since it started
                "errors": sum(1 for s in streams if s.error is not None),
                "sent": len(streams),
                "ttft_p50_s": percentile(ttft, 50),
                "ttft_p99_s": percentile(ttft, 99),
                "ttft_first_s": mine[0].ttft_s if mine else None,
                "warm_up": state,
                "engine": joiner.info,
            }
            previous = joiner
    return out
